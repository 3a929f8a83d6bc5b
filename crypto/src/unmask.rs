//! Removing the masks from the sum of masked inputs.
//!
//! For each survivor u the server reconstructs b_u, checks it against u's
//! advertised commitment and subtracts PRG(b_u); for each client v that
//! shared keys but sent no masked input it reconstructs s_sk_v, checks it
//! against v's advertised s_pk, and removes every pairwise mask between v
//! and a surviving neighbour. The masks are removed from the sum tile by
//! tile on the worker threads (see [`crate::masking`]).

use subtle::ConstantTimeEq;

use crate::agreement::{AgreementKey, PeerKey};
use crate::config::RoundContext;
use crate::derive;
use crate::error::{CryptoError, ProtocolError, Stage};
use crate::ids::ClientId;
use crate::masking::{Mask, apply_masks_in_parallel};
use crate::messages::AdvertisedKeys;
use crate::prg::MaskSign;
use crate::secret::Secret32;
use crate::shamir::{Reconstructor, Share};

/// A share revealed in the unmasking stage that does not lie on its owner's
/// committed secret: `holder` sent it for `owner`'s secret. Either the
/// holder altered it or the owner dealt it wrong; the server cannot tell
/// which, only that this share was not used.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct FaultyShare {
    /// Whose secret the share belongs to.
    pub owner: ClientId,
    /// Who revealed it.
    pub holder: ClientId,
}

/// Everything the unmasking step reads.
pub(crate) struct UnmaskJob<'a> {
    pub context: &'a RoundContext,
    pub threshold: usize,
    pub keys: &'a [Option<AdvertisedKeys>],
    pub survivors: &'a [ClientId],
    pub dropped: &'a [ClientId],
    pub self_mask_shares: &'a [Vec<Share>],
    pub mask_key_shares: &'a [Vec<Share>],
    pub partners_of_dropped: &'a (dyn Fn(ClientId) -> Vec<ClientId> + Sync),
}

/// Subtracts every remaining mask from `sum` (modulo 2^32) and returns the
/// revealed shares that were wrong and how many masks were removed (each a
/// key stream as long as the vector).
///
/// Every reconstructed secret is checked before it is used: a survivor's
/// seed against the commitment it advertised, a dropped client's mask key
/// against its advertised public key. When the first t shares do not give
/// the committed value, the shares are decoded with error correction, the
/// holders of the wrong ones are named, and unmasking goes on without them;
/// when too many are wrong to correct, the round fails and nothing wrong is
/// ever subtracted.
pub(crate) fn unmask(
    job: &UnmaskJob<'_>,
    sum: &mut [u32],
) -> Result<(Vec<FaultyShare>, usize), ProtocolError> {
    let reconstruct = |reconstructor: &mut Reconstructor,
                       owner: ClientId,
                       shares: &[Share],
                       check: &dyn Fn(&Secret32) -> bool| {
        if shares.len() < job.threshold {
            return Err(ProtocolError::BelowThreshold {
                stage: Stage::Unmasking,
                have: shares.len() as u32,
                need: job.threshold as u32,
            });
        }
        let refs: Vec<&Share> = shares.iter().collect();
        let checked = reconstructor
            .reconstruct_checked(&refs, job.threshold, check)
            .map_err(|_| ProtocolError::UnverifiableSecret { owner, shares: shares.len() as u32 })?;
        let faulty: Vec<FaultyShare> = checked
            .faulty
            .iter()
            .filter_map(|&point| ClientId::new(point))
            .map(|holder| FaultyShare { owner, holder })
            .collect();
        Ok((checked.secret, faulty))
    };
    let advertised = |owner: ClientId| job.keys[owner.index()].as_ref().ok_or(CryptoError);
    let mut faulty = Vec::new();
    let seeds = reconstruct_each(job.survivors, &mut faulty, |reconstructor, u| {
        let commitment = advertised(u)?.seed_commitment;
        let check =
            |seed: &Secret32| bool::from(derive::seed_commitment(job.context, u, seed).ct_eq(&commitment));
        reconstruct(reconstructor, u, &job.self_mask_shares[u.index()], &check)
    })?;
    let keys = reconstruct_each(job.dropped, &mut faulty, |reconstructor, v| {
        let public = advertised(v)?.mask_key;
        let check = |secret: &Secret32| AgreementKey::from_secret(secret).public_key() == public;
        reconstruct(reconstructor, v, &job.mask_key_shares[v.index()], &check)
    })?;
    let seeds: Vec<(ClientId, Secret32)> = job.survivors.iter().copied().zip(seeds).collect();
    let dropped_keys: Vec<(ClientId, AgreementKey)> =
        job.dropped.iter().zip(&keys).map(|(&v, secret)| (v, AgreementKey::from_secret(secret))).collect();
    let mut masks: Vec<Mask> = seeds
        .iter()
        .map(|(owner, seed)| Mask {
            prg: derive::self_mask(seed, job.context, *owner),
            sign: MaskSign::Add.inverse(),
        })
        .collect();
    // Each survivor's mask key is prepared once, however many dropped
    // neighbours it has; each dropped client's agreements go as one batch.
    let mut prepared: Vec<Option<PeerKey>> = vec![None; job.keys.len()];
    let mut partners = Vec::with_capacity(dropped_keys.len());
    for (v, key) in &dropped_keys {
        let list = (job.partners_of_dropped)(*v);
        for u in &list {
            if prepared[u.index()].is_none() {
                prepared[u.index()] = Some(PeerKey::new(&advertised(*u)?.mask_key));
            }
        }
        partners.push((*v, key, list));
    }
    let agree = |(_, key, list): &(ClientId, &AgreementKey, Vec<ClientId>)| {
        let peers: Vec<&PeerKey> = list.iter().filter_map(|u| prepared[u.index()].as_ref()).collect();
        key.agree_many(&peers)
    };
    #[cfg(feature = "parallel")]
    let agreed: Vec<_> = {
        use rayon::prelude::*;
        partners.par_iter().map(agree).collect()
    };
    #[cfg(not(feature = "parallel"))]
    let agreed: Vec<_> = partners.iter().map(agree).collect();
    for ((v, _, list), shared) in partners.iter().zip(agreed) {
        for (u, shared) in list.iter().zip(shared) {
            // The survivor u applied PRG(s_uv) with its sign; the server
            // applies the other.
            masks.push(Mask {
                prg: derive::pairwise_mask(&shared?, job.context, *v, *u),
                sign: derive::pairwise_sign(*u, *v).inverse(),
            });
        }
    }
    apply_masks_in_parallel(&masks, sum);
    faulty.sort_unstable();
    Ok((faulty, masks.len()))
}

/// Each owner's secret by `reconstruct`, every one on its own (in parallel,
/// each worker thread with its own cache of Lagrange coefficients), in the
/// owners' order; the wrong shares found go to `faulty`, and the first
/// failure in that order fails the round.
fn reconstruct_each(
    owners: &[ClientId],
    faulty: &mut Vec<FaultyShare>,
    reconstruct: impl Fn(&mut Reconstructor, ClientId) -> Result<(Secret32, Vec<FaultyShare>), ProtocolError>
    + Sync
    + Send,
) -> Result<Vec<Secret32>, ProtocolError> {
    #[cfg(feature = "parallel")]
    let results: Vec<_> = {
        use rayon::prelude::*;
        owners
            .par_iter()
            .map_init(Reconstructor::new, |reconstructor, &owner| reconstruct(reconstructor, owner))
            .collect()
    };
    #[cfg(not(feature = "parallel"))]
    let results: Vec<_> = {
        let mut reconstructor = Reconstructor::new();
        owners.iter().map(|&owner| reconstruct(&mut reconstructor, owner)).collect()
    };
    results
        .into_iter()
        .map(|result| {
            let (secret, wrong) = result?;
            faulty.extend(wrong);
            Ok(secret)
        })
        .collect()
}
