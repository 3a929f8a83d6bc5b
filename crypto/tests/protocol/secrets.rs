//! Secret-bearing types can be neither printed nor copied.

use cohort_crypto::agreement::AgreementKey;
use cohort_crypto::envelope::EnvelopeKey;
use cohort_crypto::messages::{ClientMessage, UnmaskingShares};
use cohort_crypto::prg::{KeyStream, MaskPrg, StreamBuffer};
use cohort_crypto::shamir::Share;
use cohort_crypto::signature::IdentityKey;
use cohort_crypto::{Client, QuantizedInput, Secret32};
use static_assertions::{assert_impl_all, assert_not_impl_any};

assert_not_impl_any!(Secret32: core::fmt::Debug, Clone, Copy);
assert_not_impl_any!(Share: core::fmt::Debug, Clone, Copy);
assert_not_impl_any!(AgreementKey: core::fmt::Debug, Clone);
assert_not_impl_any!(IdentityKey: core::fmt::Debug, Clone);
assert_not_impl_any!(EnvelopeKey: core::fmt::Debug, Clone);
assert_not_impl_any!(MaskPrg: core::fmt::Debug, Clone);
assert_not_impl_any!(KeyStream<'static>: core::fmt::Debug, Clone);
assert_not_impl_any!(StreamBuffer: core::fmt::Debug, Clone);
assert_not_impl_any!(QuantizedInput: core::fmt::Debug, Clone);
assert_not_impl_any!(UnmaskingShares: core::fmt::Debug, Clone);
assert_not_impl_any!(ClientMessage: Clone);
// What the identity and agreement keys hold wipes itself on drop.
assert_impl_all!(ed25519_dalek::SigningKey: zeroize::ZeroizeOnDrop);
assert_impl_all!(x25519_dalek::StaticSecret: zeroize::ZeroizeOnDrop);

/// `Debug` on a client state or message prints the stage, never key
/// material or shares.
#[test]
fn debug_output_of_states_and_messages_is_redacted() {
    use cohort_crypto::ClientMessage;
    use cohort_crypto::RoundContext;
    let message = ClientMessage::Unmasking {
        context: RoundContext([0; 32]),
        shares: UnmaskingShares { self_mask: Vec::new(), mask_key: Vec::new() },
    };
    assert_eq!(format!("{message:?}"), "ClientMessage { stage: Unmasking, .. }");
    assert_eq!(format!("{:?}", Client::Finished), "Client { stage: Finished, .. }");
}
