//! Removing the masks from the sum of masked inputs.
//!
//! For each survivor u the server reconstructs b_u, checks it against u's
//! advertised commitment and subtracts PRG(b_u); for each client v that
//! shared keys but sent no masked input it reconstructs s_sk_v, checks it
//! against v's advertised s_pk, and removes every pairwise mask between v
//! and a surviving neighbour. The masks are removed from the sum one
//! cache-sized tile at a time, every mask's key stream for that tile's
//! counter range in turn; the vector is cut into ranges of tiles that the
//! worker threads take (feature `parallel`), each range setting up every
//! mask's cipher once.

use subtle::ConstantTimeEq;

use crate::agreement::{AgreementKey, PeerKey};
use crate::config::RoundContext;
use crate::derive;
use crate::error::{CryptoError, ProtocolError, Stage};
use crate::ids::ClientId;
use crate::messages::AdvertisedKeys;
use crate::prg::{KeyStream, MaskPrg, MaskSign, StreamBuffer, WORDS_PER_BLOCK};
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
    remove_masks(&masks, sum);
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

/// A mask to remove: its generator and the sign that removes it.
struct Mask {
    prg: MaskPrg,
    sign: MaskSign,
}

/// Key-stream words per tile: 8 KiB, which stays in a core's L1 cache,
/// beside one call's key stream, while every mask is removed from it. (As
/// fast as tiles of 256 KiB in L2, or slightly faster: each mask's cipher
/// is set up once per range, so a small tile costs one call per mask and
/// nothing more.)
const TILE_WORDS: usize = 1 << 11;
/// Ranges per worker thread: a few, so that a thread that finishes early
/// takes another's work, and few, because each range sets up every mask's
/// cipher once.
const RANGES_PER_THREAD: usize = 4;

/// Words per range for a vector of `len` words on `threads` threads: about
/// [`RANGES_PER_THREAD`] ranges per thread, a whole number of AES blocks (so
/// that each range starts at a block boundary) and of tiles when there is
/// more than one.
fn range_words(len: usize, threads: usize) -> usize {
    let even = len.div_ceil(threads.max(1) * RANGES_PER_THREAD).max(1);
    if even > TILE_WORDS { even.next_multiple_of(TILE_WORDS) } else { even.next_multiple_of(WORDS_PER_BLOCK) }
}

/// Removes every mask from `sum`. The vector is cut into contiguous ranges
/// (the worker threads take them in turn, feature `parallel`); a range
/// sets up each mask's key stream at its first block and walks its tiles in
/// order, each tile taking every mask's next key stream while it sits in
/// cache. So the sum is read and written once however many masks there
/// are, no vector of masks is ever held, and each mask's cipher is set up
/// once per range rather than once per tile.
fn remove_masks(masks: &[Mask], sum: &mut [u32]) {
    #[cfg(feature = "parallel")]
    let threads = rayon::current_num_threads();
    #[cfg(not(feature = "parallel"))]
    let threads = 1;
    remove_in_ranges(masks, sum, range_words(sum.len(), threads), TILE_WORDS);
}

/// [`remove_masks`] with ranges of `range` words and tiles of `tile` words
/// (both whole AES blocks).
fn remove_in_ranges(masks: &[Mask], sum: &mut [u32], range: usize, tile: usize) {
    debug_assert!(range % WORDS_PER_BLOCK == 0 && tile % WORDS_PER_BLOCK == 0);
    let remove = |(index, words): (usize, &mut [u32])| {
        let first_block = (index * range / WORDS_PER_BLOCK) as u64;
        let mut streams: Vec<KeyStream<'_>> =
            masks.iter().map(|mask| mask.prg.stream_from(first_block)).collect();
        let mut buffer = StreamBuffer::new();
        for tile in words.chunks_mut(tile) {
            for (stream, mask) in streams.iter_mut().zip(masks) {
                stream.apply_next(tile, mask.sign, &mut buffer);
            }
        }
    };
    #[cfg(feature = "parallel")]
    {
        use rayon::prelude::*;
        sum.par_chunks_mut(range).enumerate().for_each(remove);
    }
    #[cfg(not(feature = "parallel"))]
    sum.chunks_mut(range).enumerate().for_each(remove);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Masks removed range by range and tile by tile, each mask's stream
    /// carried from one tile to the next, leave what removing each whole
    /// mask leaves: for ranges and tiles of several sizes, a tail that is
    /// no whole block, and both signs.
    #[test]
    fn removing_masks_by_ranges_and_tiles_equals_removing_each_whole() {
        let masks: Vec<Mask> = (0u8..5)
            .map(|i| Mask {
                prg: MaskPrg::from_key(&[i.wrapping_mul(37).wrapping_add(1); 16]),
                sign: if i % 2 == 0 { MaskSign::Subtract } else { MaskSign::Add },
            })
            .collect();
        for len in [1usize, 5, 64, 1003, 10_001] {
            let start: Vec<u32> = (0..len as u32).map(|i| i.wrapping_mul(2_654_435_761)).collect();
            let mut expected = start.clone();
            for mask in &masks {
                mask.prg.apply(&mut expected, mask.sign);
            }
            for (range, tile) in
                [(4, 4), (64, 8), (1000, 64), (4096, 2048), (2048, 4096), (len.next_multiple_of(4), 12)]
            {
                let mut sum = start.clone();
                remove_in_ranges(&masks, &mut sum, range, tile);
                assert_eq!(sum, expected, "len {len}, ranges of {range}, tiles of {tile}");
            }
        }
        // The sizes used for long vectors: whole tiles per range.
        assert_eq!(range_words(10_000_000, 2) % TILE_WORDS, 0);
        assert_eq!(range_words(10_001, 2) % WORDS_PER_BLOCK, 0);
        assert!(range_words(1, 2) >= WORDS_PER_BLOCK);
    }
}
