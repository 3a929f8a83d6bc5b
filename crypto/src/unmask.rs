//! Removing the masks from the sum of masked inputs.
//!
//! For each survivor u the server reconstructs b_u, checks it against u's
//! advertised commitment and subtracts PRG(b_u); for each client v that
//! shared keys but sent no masked input it reconstructs s_sk_v, checks it
//! against v's advertised s_pk, and removes every pairwise mask between v
//! and a surviving neighbour. The mask expansions are independent, so they
//! run in parallel (feature `parallel`) into per-thread accumulators that are
//! summed at the end.

use subtle::ConstantTimeEq;
use zeroize::Zeroizing;

use crate::agreement::{AgreementKey, PeerKey};
use crate::config::RoundContext;
use crate::derive;
use crate::error::{CryptoError, ProtocolError, Stage};
use crate::ids::ClientId;
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

enum Task<'a> {
    SelfMask { owner: ClientId, seed: &'a Secret32 },
    Pairwise { dropped: ClientId, survivor: ClientId, shared: Secret32 },
}

/// Subtracts every remaining mask from `sum` (modulo 2^32) and returns the
/// revealed shares that were wrong.
///
/// Every reconstructed secret is checked before it is used: a survivor's
/// seed against the commitment it advertised, a dropped client's mask key
/// against its advertised public key. When the first t shares do not give
/// the committed value, the shares are decoded with error correction, the
/// holders of the wrong ones are named, and unmasking goes on without them;
/// when too many are wrong to correct, the round fails and nothing wrong is
/// ever subtracted.
pub(crate) fn unmask(job: &UnmaskJob<'_>, sum: &mut [u32]) -> Result<Vec<FaultyShare>, ProtocolError> {
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
    let mut tasks: Vec<Task<'_>> =
        seeds.iter().map(|(owner, seed)| Task::SelfMask { owner: *owner, seed }).collect();
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
            tasks.push(Task::Pairwise { dropped: *v, survivor: *u, shared: shared? });
        }
    }
    let masks = total_mask(job.context, &tasks, sum.len());
    for (value, mask) in sum.iter_mut().zip(masks.iter()) {
        *value = value.wrapping_sub(*mask);
    }
    faulty.sort_unstable();
    Ok(faulty)
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

/// Applies one task's mask to `acc` exactly as its client applied it.
fn apply(context: &RoundContext, task: &Task<'_>, acc: &mut [u32]) {
    match task {
        Task::SelfMask { owner, seed } => derive::self_mask(seed, context, *owner).apply(acc, MaskSign::Add),
        Task::Pairwise { dropped, survivor, shared } => {
            derive::pairwise_mask(shared, context, *dropped, *survivor)
                .apply(acc, derive::pairwise_sign(*survivor, *dropped))
        }
    }
}

/// The sum of all the tasks' masks.
#[cfg(feature = "parallel")]
fn total_mask(context: &RoundContext, tasks: &[Task<'_>], len: usize) -> Zeroizing<Vec<u32>> {
    use rayon::prelude::*;
    tasks
        .par_iter()
        .with_min_len(4)
        .fold(
            || Zeroizing::new(vec![0u32; len]),
            |mut acc, task| {
                apply(context, task, &mut acc);
                acc
            },
        )
        .reduce(
            || Zeroizing::new(vec![0u32; len]),
            |mut a, b| {
                for (x, y) in a.iter_mut().zip(b.iter()) {
                    *x = x.wrapping_add(*y);
                }
                a
            },
        )
}

/// The sum of all the tasks' masks.
#[cfg(not(feature = "parallel"))]
fn total_mask(context: &RoundContext, tasks: &[Task<'_>], len: usize) -> Zeroizing<Vec<u32>> {
    let mut acc = Zeroizing::new(vec![0u32; len]);
    for task in tasks {
        apply(context, task, &mut acc);
    }
    acc
}
