//! Applying many masks to one long vector: what a client does to mask its
//! input and what the server does to remove the remaining masks from the
//! sum.
//!
//! Each mask is a key stream as long as the vector, added or subtracted
//! word by word. Applied one whole mask after another, a vector larger
//! than the cache would be read from and written to memory once per mask;
//! here it is walked one cache-sized tile at a time instead, every mask's
//! key stream for that tile's counter range in turn (the masks of one sign
//! several per pass over the tile), so the vector is read and written once
//! however many masks there are, and no mask is ever held whole. A range of
//! tiles sets up each mask's cipher once; the server cuts the vector into
//! ranges that its worker threads take (feature `parallel`), a client
//! walks its vector as one range on its own thread.

use crate::prg::{KeyStream, MaskPrg, MaskSign, StreamBuffer, WORDS_PER_BLOCK, apply_next_together};

/// A mask to apply: its generator and its sign.
pub(crate) struct Mask {
    pub prg: MaskPrg,
    pub sign: MaskSign,
}

/// Key-stream words per tile: 8 KiB, which stays in a core's L1 cache,
/// beside the key stream of the masks added to it in one pass, while every
/// mask is applied to it. (As fast as tiles of 256 KiB in L2, or slightly
/// faster: each mask's cipher is set up once per range, so a small tile
/// costs one call per mask and nothing more.)
const TILE_WORDS: usize = 1 << 11;
/// Ranges per worker thread: a few, so that a thread that finishes early
/// takes another's work, and few, because each range sets up every mask's
/// cipher once.
const RANGES_PER_THREAD: usize = 4;

/// Applies every mask to `vector` on this thread, as one range, and then
/// `finish` to each tile while it is still in cache (a client reduces its
/// masked words modulo 2^b there).
pub(crate) fn apply_masks(masks: &[Mask], vector: &mut [u32], finish: impl Fn(&mut [u32])) {
    apply_range(masks, 0, vector, TILE_WORDS, &finish);
}

/// Applies every mask to `vector`, the vector cut into contiguous ranges
/// that the worker threads take in turn (feature `parallel`).
pub(crate) fn apply_masks_in_parallel(masks: &[Mask], vector: &mut [u32]) {
    #[cfg(feature = "parallel")]
    let threads = rayon::current_num_threads();
    #[cfg(not(feature = "parallel"))]
    let threads = 1;
    apply_in_ranges(masks, vector, range_words(vector.len(), threads), TILE_WORDS);
}

/// Words per range for a vector of `len` words on `threads` threads: about
/// [`RANGES_PER_THREAD`] ranges per thread, a whole number of AES blocks (so
/// that each range starts at a block boundary) and of tiles when there is
/// more than one.
fn range_words(len: usize, threads: usize) -> usize {
    let even = len.div_ceil(threads.max(1) * RANGES_PER_THREAD).max(1);
    if even > TILE_WORDS { even.next_multiple_of(TILE_WORDS) } else { even.next_multiple_of(WORDS_PER_BLOCK) }
}

/// [`apply_masks_in_parallel`] with ranges of `range` words and tiles of
/// `tile` words (both whole AES blocks).
fn apply_in_ranges(masks: &[Mask], vector: &mut [u32], range: usize, tile: usize) {
    debug_assert!(range % WORDS_PER_BLOCK == 0 && tile % WORDS_PER_BLOCK == 0);
    let apply = |(index, words): (usize, &mut [u32])| {
        apply_range(masks, (index * range / WORDS_PER_BLOCK) as u64, words, tile, &|_: &mut [u32]| {});
    };
    #[cfg(feature = "parallel")]
    {
        use rayon::prelude::*;
        vector.par_chunks_mut(range).enumerate().for_each(apply);
    }
    #[cfg(not(feature = "parallel"))]
    vector.chunks_mut(range).enumerate().for_each(apply);
}

/// Applies every mask to `words`, which start at key-stream block
/// `first_block`: each mask's stream is set up there once and read in
/// order, a tile of `tile` words (a whole number of blocks) at a time, the
/// masks of each sign added to the tile together; then `finish` takes the
/// tile.
fn apply_range(
    masks: &[Mask],
    first_block: u64,
    words: &mut [u32],
    tile: usize,
    finish: &dyn Fn(&mut [u32]),
) {
    let streams_with = |sign: MaskSign| -> Vec<KeyStream<'_>> {
        masks.iter().filter(|mask| mask.sign == sign).map(|mask| mask.prg.stream_from(first_block)).collect()
    };
    let mut by_sign = [MaskSign::Add, MaskSign::Subtract].map(|sign| (sign, streams_with(sign)));
    let mut buffer = StreamBuffer::new();
    for tile in words.chunks_mut(tile) {
        for (sign, streams) in &mut by_sign {
            apply_next_together(streams, *sign, tile, &mut buffer);
        }
        finish(tile);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn masks(count: u8) -> Vec<Mask> {
        (0..count)
            .map(|i| Mask {
                prg: MaskPrg::from_key(&[i.wrapping_mul(37).wrapping_add(1); 16]),
                sign: if i % 3 == 0 { MaskSign::Subtract } else { MaskSign::Add },
            })
            .collect()
    }

    /// Masks applied range by range and tile by tile, each mask's stream
    /// carried from one tile to the next and the masks of a sign added
    /// together, leave what applying each whole mask in turn leaves: for
    /// ranges and tiles of several sizes, a tail that is no whole block,
    /// and both signs (nine masks: six added, four or two per pass, and
    /// three subtracted).
    #[test]
    fn masks_applied_by_ranges_and_tiles_equal_each_applied_whole() {
        let masks = masks(9);
        for len in [1usize, 5, 64, 1003, 10_001] {
            let start: Vec<u32> = (0..len as u32).map(|i| i.wrapping_mul(2_654_435_761)).collect();
            let mut expected = start.clone();
            for mask in &masks {
                mask.prg.apply(&mut expected, mask.sign);
            }
            for (range, tile) in
                [(4, 4), (64, 8), (1000, 64), (4096, 2048), (2048, 4096), (len.next_multiple_of(4), 12)]
            {
                let mut vector = start.clone();
                apply_in_ranges(&masks, &mut vector, range, tile);
                assert_eq!(vector, expected, "len {len}, ranges of {range}, tiles of {tile}");
            }
            // As a client applies them: one range, then its own step on
            // each tile.
            let mut vector = start.clone();
            apply_masks(&masks, &mut vector, |tile| tile.iter_mut().for_each(|word| *word &= 0xffff));
            let reduced: Vec<u32> = expected.iter().map(|word| word & 0xffff).collect();
            assert_eq!(vector, reduced, "len {len}, one range");
        }
        // The sizes used for long vectors: whole tiles per range.
        assert_eq!(range_words(10_000_000, 2) % TILE_WORDS, 0);
        assert_eq!(range_words(10_001, 2) % WORDS_PER_BLOCK, 0);
        assert!(range_words(1, 2) >= WORDS_PER_BLOCK);
    }
}
