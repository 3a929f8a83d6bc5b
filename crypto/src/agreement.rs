//! X25519 key agreement (RFC 7748). Keys are `x25519-dalek`'s; the
//! agreement itself is computed on the birationally equivalent Edwards
//! curve (see [`x25519`]).

use curve25519_dalek::edwards::EdwardsPoint;
use curve25519_dalek::montgomery::MontgomeryPoint;
use rand_core::CryptoRng;
use subtle::ConstantTimeEq;
use x25519_dalek::{PublicKey, StaticSecret};
use zeroize::Zeroizing;

use crate::error::CryptoError;
use crate::secret::Secret32;

/// An X25519 secret key and its public key.
///
/// The secret is zeroized on drop. It can be exported only as a
/// [`Secret32`], to be Shamir-shared.
pub struct AgreementKey {
    secret: StaticSecret,
    public: [u8; 32],
}

impl AgreementKey {
    /// Draws a fresh key pair.
    pub fn generate<R: CryptoRng + ?Sized>(rng: &mut R) -> Self {
        Self::from_static(StaticSecret::random_from_rng(rng))
    }

    /// Rebuilds a key pair from its 32-byte secret (for example after Shamir
    /// reconstruction).
    pub fn from_secret(secret: &Secret32) -> Self {
        Self::from_static(StaticSecret::from(*secret.expose()))
    }

    fn from_static(secret: StaticSecret) -> Self {
        let public = PublicKey::from(&secret).to_bytes();
        Self { secret, public }
    }

    /// The public key.
    pub fn public_key(&self) -> [u8; 32] {
        self.public
    }

    /// The secret scalar as shareable secret bytes.
    pub fn export_secret(&self) -> Secret32 {
        let mut bytes = Zeroizing::new(self.secret.to_bytes());
        Secret32::from_bytes(&mut bytes)
    }

    /// X25519 with `their_public`. Fails on a non-contributory result (a
    /// low-order peer key), which would make the shared secret predictable.
    pub fn agree(&self, their_public: &[u8; 32]) -> Result<Secret32, CryptoError> {
        let scalar = Zeroizing::new(self.secret.to_bytes());
        contributory(Zeroizing::new(x25519(&scalar, their_public)))
    }

    /// [`agree`](Self::agree) with each of `peers`, in order: the same
    /// results, faster. The peers' keys come already mapped to the Edwards
    /// form ([`PeerKey`]), and the results are mapped back with one field
    /// inversion for the whole batch instead of one each.
    pub fn agree_many(&self, peers: &[&PeerKey]) -> Vec<Result<Secret32, CryptoError>> {
        let scalar = Zeroizing::new(self.secret.to_bytes());
        let products: Zeroizing<Vec<EdwardsPoint>> = Zeroizing::new(
            peers.iter().filter_map(|peer| peer.edwards).map(|e| e.mul_clamped(*scalar)).collect(),
        );
        let on_curve = Zeroizing::new(EdwardsPoint::to_montgomery_batch(&products));
        let mut on_curve = on_curve.iter();
        peers
            .iter()
            .map(|peer| {
                let shared = match peer.edwards {
                    Some(_) => on_curve.next().map(|u| u.to_bytes()).ok_or(CryptoError)?,
                    None => MontgomeryPoint(peer.public).mul_clamped(*scalar).to_bytes(),
                };
                contributory(Zeroizing::new(shared))
            })
            .collect()
    }
}

/// The u-coordinates, reduced modulo p = 2^255 − 19, of the points of
/// small order: on the curve those of order 2 (u = 0), 4 (u = 1) and 8, on
/// the twist that of order 4 (u = p − 1). X25519 with any scalar maps
/// exactly these (and their non-canonical encodings) to zero.
const LOW_ORDER: [[u8; 32]; 5] = {
    let mut table = [[0u8; 32]; 5];
    table[1][0] = 1;
    table[2] = [
        0xe0, 0xeb, 0x7a, 0x7c, 0x3b, 0x41, 0xb8, 0xae, 0x16, 0x56, 0xe3, 0xfa, 0xf1, 0x9f, 0xc4, 0x6a, 0xda,
        0x09, 0x8d, 0xeb, 0x9c, 0x32, 0xb1, 0xfd, 0x86, 0x62, 0x05, 0x16, 0x5f, 0x49, 0xb8, 0x00,
    ];
    table[3] = [
        0x5f, 0x9c, 0x95, 0xbc, 0xa3, 0x50, 0x8c, 0x24, 0xb1, 0xd0, 0xb1, 0x55, 0x9c, 0x83, 0xef, 0x5b, 0x04,
        0x44, 0x5c, 0xc4, 0x58, 0x1c, 0x8e, 0x86, 0xd8, 0x22, 0x4e, 0xdd, 0xd0, 0x9f, 0x11, 0x57,
    ];
    table[4] = [0xff; 32];
    table[4][0] = 0xec;
    table[4][31] = 0x7f;
    table
};

/// Whether an X25519 public key is of small order, so that every
/// agreement with it is all zeros: the check a coordinator makes on each
/// advertised key, without a scalar multiplication.
pub fn is_low_order(u: &[u8; 32]) -> bool {
    let mut u = *u;
    u[31] &= 0x7f;
    // Below 2^255 = p + 19, a non-canonical u is p + k with k < 19.
    if u[31] == 0x7f && u[1..31].iter().all(|&b| b == 0xff) && u[0] >= 0xed {
        let k = u[0] - 0xed;
        u = [0; 32];
        u[0] = k;
    }
    LOW_ORDER.contains(&u)
}

/// Whether `u` is a canonical X25519 u-coordinate: bit 255 clear and
/// below p = 2^255 − 19. RFC 7748 has X25519 ignore bit 255 and reduce a
/// larger u, as this crate does; a host's implementation need not (see
/// [`crate::client::PendingStep::agreed`]).
pub fn is_canonical(u: &[u8; 32]) -> bool {
    // p is 0x7fff…ffed, little-endian: u < p unless its top byte is 0x7f,
    // its middle bytes all 0xff and its low byte at least 0xed.
    u[31] < 0x7f || (u[31] == 0x7f && (u[1..31].iter().any(|&b| b != 0xff) || u[0] < 0xed))
}

/// A peer's X25519 public key prepared for [`AgreementKey::agree_many`]:
/// mapped once to the Edwards form (a square root), so that a party that
/// agrees with the same peer under several of its own keys (the server
/// removing the masks of dropped clients) maps it once.
#[derive(Debug, Clone)]
pub struct PeerKey {
    public: [u8; 32],
    /// `None` for a u on the twist or u = −1: those take the ladder.
    edwards: Option<EdwardsPoint>,
}

impl PeerKey {
    /// Prepares `public`.
    pub fn new(public: &[u8; 32]) -> Self {
        Self { public: *public, edwards: MontgomeryPoint(*public).to_edwards(0) }
    }
}

/// `shared`, unless it is all zeros: the check [`AgreementKey::agree`]
/// makes, for an agreement a host computed (see
/// [`PendingStep`](crate::client::PendingStep)).
pub(crate) fn check_contributory(shared: Secret32) -> Result<Secret32, CryptoError> {
    if bool::from(shared.expose().ct_eq(&[0u8; 32])) { Err(CryptoError) } else { Ok(shared) }
}

/// The shared secret, unless it is all zeros: a low-order peer key, which
/// would make it predictable.
fn contributory(mut shared: Zeroizing<[u8; 32]>) -> Result<Secret32, CryptoError> {
    if bool::from(shared.ct_eq(&[0u8; 32])) {
        return Err(CryptoError);
    }
    Ok(Secret32::from_bytes(&mut shared))
}

/// The X25519 function of RFC 7748: the u-coordinate of `[clamp(scalar)] P`
/// for a point P with u-coordinate `u`, bit 255 of `u` ignored and a
/// non-canonical `u` reduced modulo 2^255 − 19.
///
/// A u on the curve itself (every honest public key) is mapped to the
/// Edwards form, multiplied there and mapped back: the Edwards scalar
/// multiplication has a vectorised backend (AVX2 where the processor has
/// it), which the Montgomery ladder lacks, and the u-coordinate of the
/// result does not depend on which of the two Edwards points over u is
/// taken. A u on the quadratic twist, or u = −1 (which has no Edwards
/// image), goes through the Montgomery ladder. Both paths are constant-time
/// in the scalar and give the same result as the ladder for every input
/// (tested against `x25519-dalek` and RFC 7748's vectors).
pub fn x25519(scalar: &[u8; 32], u: &[u8; 32]) -> [u8; 32] {
    let point = MontgomeryPoint(*u);
    match point.to_edwards(0) {
        Some(edwards) => edwards.mul_clamped(*scalar).to_montgomery().to_bytes(),
        None => point.mul_clamped(*scalar).to_bytes(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand_chacha::ChaCha20Rng;
    use rand_core::SeedableRng;

    #[test]
    fn canonical_u_coordinates_are_those_below_p_with_bit_255_clear() {
        let p_minus = |k: u8| {
            let mut u = [0xff; 32];
            u[31] = 0x7f;
            u[0] = 0xed - k;
            u
        };
        assert!(is_canonical(&[0; 32]) && is_canonical(&[9; 32]) && is_canonical(&p_minus(1)));
        assert!(!is_canonical(&p_minus(0)), "p itself");
        let mut above = p_minus(0);
        above[0] = 0xff;
        assert!(!is_canonical(&above), "2^255 - 1");
        let mut high_bit = [9u8; 32];
        high_bit[31] |= 0x80;
        assert!(!is_canonical(&high_bit), "bit 255 set");
        let mut below = p_minus(0);
        below[17] = 0xfe;
        assert!(is_canonical(&below));
    }

    #[test]
    fn both_sides_agree() {
        let mut rng = ChaCha20Rng::seed_from_u64(3);
        let a = AgreementKey::generate(&mut rng);
        let b = AgreementKey::generate(&mut rng);
        let ab = a.agree(&b.public_key()).unwrap();
        let ba = b.agree(&a.public_key()).unwrap();
        assert!(ab == ba);
    }

    #[test]
    fn low_order_points_are_rejected() {
        let mut rng = ChaCha20Rng::seed_from_u64(4);
        let a = AgreementKey::generate(&mut rng);
        // The identity (u = 0) and u = 1 are of low order on Curve25519.
        assert_eq!(a.agree(&[0u8; 32]).err(), Some(CryptoError));
        let mut one = [0u8; 32];
        one[0] = 1;
        assert_eq!(a.agree(&one).err(), Some(CryptoError));
    }

    fn hex32(s: &str) -> [u8; 32] {
        hex::decode(s).unwrap().try_into().unwrap()
    }

    /// p = 2^255 − 19, little-endian.
    const P: [u8; 32] = {
        let mut p = [0xffu8; 32];
        p[0] = 0xed;
        p[31] = 0x7f;
        p
    };

    /// The ladder of `x25519-dalek`, the reference for [`x25519`].
    fn ladder(scalar: &[u8; 32], u: &[u8; 32]) -> [u8; 32] {
        StaticSecret::from(*scalar).diffie_hellman(&PublicKey::from(*u)).to_bytes()
    }

    /// Every kind of u: random (a curve point or a twist point, about half
    /// each), bit 255 set, non-canonical (u ≥ p), the low-order points and
    /// u = −1, each against the ladder.
    #[test]
    fn the_edwards_path_matches_the_ladder_on_every_kind_of_input() {
        use rand::RngExt;
        let mut rng = ChaCha20Rng::seed_from_u64(6);
        let p = P;
        let add = |base: [u8; 32], k: u8| {
            let mut out = base;
            let (sum, carry) = out[0].overflowing_add(k);
            out[0] = sum;
            assert!(!carry || k == 0, "small offsets only");
            out
        };
        let mut special = vec![[0u8; 32], add([0u8; 32], 1), add(p, 0), add(p, 1), [0xffu8; 32]];
        let mut minus_one = p;
        minus_one[0] -= 1;
        special.push(minus_one);
        // The other points of order 8 (RFC 7748's low-order list).
        for hex in [
            "e0eb7a7c3b41b8ae1656e3faf19fc46ada098deb9c32b1fd866205165f49b800",
            "5f9c95bca3508c24b1d0b1559c83ef5b04445cc4581c8e86d8224eddd09f1157",
        ] {
            special.push(hex32(hex));
        }
        let mut on_curve = 0;
        for i in 0..400 {
            let scalar: [u8; 32] = rng.random();
            let u: [u8; 32] = if i < special.len() { special[i] } else { rng.random() };
            on_curve += usize::from(MontgomeryPoint(u).to_edwards(0).is_some());
            assert_eq!(x25519(&scalar, &u), ladder(&scalar, &u), "u = {}", hex::encode(u));
        }
        assert!((120..=280).contains(&on_curve), "both paths taken: {on_curve} of 400 on the curve");

        // The batch gives each input's own result, the failures (low-order
        // keys) in place, whatever mix of paths it holds.
        let own = AgreementKey::generate(&mut rng);
        let mut publics: Vec<[u8; 32]> = (0..60).map(|_| rng.random()).collect();
        publics.extend(special.iter().copied());
        publics.swap(3, 61);
        let prepared: Vec<PeerKey> = publics.iter().map(PeerKey::new).collect();
        let batch = own.agree_many(&prepared.iter().collect::<Vec<_>>());
        assert_eq!(batch.len(), publics.len());
        let mut failures = 0;
        for (public, result) in publics.iter().zip(&batch) {
            match (own.agree(public), result) {
                (Ok(single), Ok(batched)) => assert!(single == *batched, "u = {}", hex::encode(public)),
                (Err(_), Err(_)) => failures += 1,
                (single, batched) => {
                    panic!("u = {}: {} against {}", hex::encode(public), single.is_ok(), batched.is_ok())
                }
            }
        }
        assert!(failures >= 4, "the low-order points fail in the batch too: {failures}");
        assert!(own.agree_many(&[]).is_empty());
    }

    /// The table holds exactly the keys whose agreements are all zeros:
    /// each of its entries, canonical or not and with bit 255 set or not,
    /// against random scalars, and none of the other keys near p or 0, nor
    /// random ones.
    #[test]
    fn the_low_order_table_is_exactly_the_keys_that_agree_to_zero() {
        use rand::RngExt;
        let mut rng = ChaCha20Rng::seed_from_u64(7);
        let p = P;
        let mut candidates: Vec<[u8; 32]> = LOW_ORDER.to_vec();
        for k in 0u8..=18 {
            let mut near_p = p;
            near_p[0] += k;
            candidates.push(near_p); // p + k, non-canonical for k
            let mut below = p;
            below[0] -= k + 1;
            candidates.push(below); // p − 1 − k
            let mut small = [0u8; 32];
            small[0] = k;
            candidates.push(small);
        }
        for candidate in candidates.clone() {
            let mut high = candidate;
            high[31] |= 0x80;
            candidates.push(high);
        }
        candidates.extend((0..500).map(|_| rng.random::<[u8; 32]>()));
        candidates.sort_unstable();
        candidates.dedup();
        let mut low = 0;
        for u in &candidates {
            let zero = (0..3).all(|_| x25519(&rng.random(), u) == [0u8; 32]);
            assert_eq!(is_low_order(u), zero, "u = {}", hex::encode(u));
            low += usize::from(zero);
        }
        // 0, 1, the two of order 8, p − 1, p and p + 1; each with bit 255 set too.
        assert_eq!(low, 14);
    }

    #[test]
    fn exported_secret_rebuilds_the_same_key() {
        let mut rng = ChaCha20Rng::seed_from_u64(5);
        let a = AgreementKey::generate(&mut rng);
        let rebuilt = AgreementKey::from_secret(&a.export_secret());
        assert_eq!(rebuilt.public_key(), a.public_key());
    }
}
