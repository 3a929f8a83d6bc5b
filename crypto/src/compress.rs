//! Linear compression that commutes with secure aggregation: every step is
//! a linear map applied by each client before quantization, so the sum of
//! the compressed updates is the compressed sum, and the server undoes it
//! after unmasking.
//!
//! * [`Rotation`]: a randomized Hadamard rotation (Suresh et al., ICML 2017)
//!   in blocks of 2^k coordinates. It spreads a vector's energy evenly, so
//!   that a fixed clipping range wastes fewer quantization levels on rare
//!   large coordinates. Orthonormal: the server inverts it exactly.
//! * [`CountSketch`]: a `rows × columns` count sketch (as in FetchSGD,
//!   Rottensteiner et al., ICML 2020) for models much larger than the
//!   upload budget; the server estimates coordinates (the median over the
//!   rows) and keeps the heaviest.
//!
//! Both are seeded with public randomness shared by all clients of a round.

use rand_chacha::ChaCha20Rng;
use rand_core::{Rng, SeedableRng};

/// A randomized Hadamard rotation `x ↦ H D x / √B` per block of `B`
/// coordinates (`D`: random signs, `H`: the Walsh–Hadamard matrix). The
/// tail after the last whole block is split into power-of-two blocks
/// (binary decomposition of its length), so nothing is padded and the
/// rotated vector is as long as the input.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rotation {
    block: usize,
    seed: [u8; 32],
}

impl Rotation {
    /// A rotation in blocks of `block` coordinates (a power of two ≥ 2).
    pub fn new(seed: [u8; 32], block: usize) -> Option<Self> {
        (block >= 2 && block.is_power_of_two()).then_some(Self { block, seed })
    }

    /// Length of the rotated form of a `len`-coordinate vector: `len`.
    pub fn rotated_len(&self, len: usize) -> usize {
        len
    }

    /// (start, size) of every block of a `len`-coordinate vector: whole
    /// blocks, then the tail's powers of two, largest first.
    pub(crate) fn blocks(&self, len: usize) -> impl Iterator<Item = (usize, usize)> {
        let whole = len / self.block * self.block;
        let full = (0..whole).step_by(self.block).map(move |start| (start, self.block));
        let tail = len - whole;
        let mut start = whole;
        let parts = (0..usize::BITS).rev().filter(move |bit| tail & (1 << bit) != 0).map(move |bit| {
            let block = (start, 1usize << bit);
            start += 1 << bit;
            block
        });
        full.chain(parts)
    }

    fn signs(&self, len: usize) -> impl Iterator<Item = f32> {
        let mut rng = ChaCha20Rng::from_seed(self.seed);
        let mut bits = 0u64;
        (0..len).map(move |i| {
            if i % 64 == 0 {
                bits = rng.next_u64();
            }
            if (bits >> (i % 64)) & 1 == 1 { 1.0 } else { -1.0 }
        })
    }

    /// Rotates `x`.
    pub fn forward(&self, x: &[f32]) -> Vec<f32> {
        let mut out = vec![0.0f32; self.rotated_len(x.len())];
        for ((o, &v), s) in out.iter_mut().zip(x).zip(self.signs(x.len())) {
            *o = v * s;
        }
        self.transform_blocks(&mut out);
        out
    }

    /// Undoes [`forward`](Self::forward), returning the first `len`
    /// coordinates.
    pub fn inverse(&self, y: &[f32], len: usize) -> Vec<f32> {
        let mut out = y.to_vec();
        out.resize(self.rotated_len(len), 0.0);
        self.unrotate(out, len)
    }

    /// Undoes [`forward`](Self::forward) of a vector padded with zeros to
    /// `y.len()` coordinates, returning its first `len`.
    pub fn inverse_padded(&self, y: &[f32], len: usize) -> Vec<f32> {
        self.unrotate(y.to_vec(), len)
    }

    /// The blocks' transform over all of `out`, then the first `len`
    /// coordinates with their signs undone.
    fn unrotate(&self, mut out: Vec<f32>, len: usize) -> Vec<f32> {
        self.transform_blocks(&mut out);
        out.truncate(len);
        for (o, s) in out.iter_mut().zip(self.signs(len)) {
            *o *= s;
        }
        out
    }

    /// H/√B on every block; H is symmetric and H·H = B·I, so this map is
    /// its own inverse.
    fn transform_blocks(&self, buffer: &mut [f32]) {
        for (start, size) in self.blocks(buffer.len()) {
            let block = &mut buffer[start..start + size];
            walsh_hadamard(block);
            let norm = 1.0 / (size as f32).sqrt();
            block.iter_mut().for_each(|v| *v *= norm);
        }
    }
}

/// The in-place fast Walsh–Hadamard transform (unnormalised) of a slice
/// whose length is a power of two.
fn walsh_hadamard(values: &mut [f32]) {
    let mut half = 1;
    while half < values.len() {
        for start in (0..values.len()).step_by(2 * half) {
            let (left, right) = values[start..start + 2 * half].split_at_mut(half);
            for (a, b) in left.iter_mut().zip(right) {
                let (x, y) = (*a, *b);
                *a = x + y;
                *b = x - y;
            }
        }
        half *= 2;
    }
}

/// A count sketch: each coordinate is added, with a random sign, to one
/// random bucket of every row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CountSketch {
    rows: usize,
    columns: usize,
    seed: [u8; 32],
}

impl CountSketch {
    /// A sketch of `rows` × `columns` buckets (both at least 1).
    pub fn new(seed: [u8; 32], rows: usize, columns: usize) -> Option<Self> {
        (rows >= 1 && columns >= 1).then_some(Self { rows, columns, seed })
    }

    /// Buckets in the table.
    pub fn len(&self) -> usize {
        self.rows * self.columns
    }

    /// Whether the table is empty (never, for a valid sketch).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// (bucket, sign) of coordinate `i` in every row, for `len` coordinates.
    fn hashes(&self, len: usize) -> impl Iterator<Item = (usize, f32)> + '_ {
        let mut rng = ChaCha20Rng::from_seed(self.seed);
        (0..len * self.rows).map(move |j| {
            let word = rng.next_u64();
            let row = j % self.rows;
            let bucket = ((word >> 1) % self.columns as u64) as usize;
            (row * self.columns + bucket, if word & 1 == 1 { 1.0 } else { -1.0 })
        })
    }

    /// The sketch of `x` (linear in `x`).
    pub fn sketch(&self, x: &[f32]) -> Vec<f32> {
        let mut table = vec![0.0f32; self.len()];
        for (j, (bucket, sign)) in self.hashes(x.len()).enumerate() {
            table[bucket] += sign * x[j / self.rows];
        }
        table
    }

    /// Every coordinate's estimate from a (summed) table: the median over
    /// the rows of its signed bucket.
    pub fn estimate(&self, table: &[f32], len: usize) -> Vec<f32> {
        let mut estimates = Vec::with_capacity(len);
        let mut row_values = Vec::with_capacity(self.rows);
        for (j, (bucket, sign)) in self.hashes(len).enumerate() {
            row_values.push(sign * table.get(bucket).copied().unwrap_or(0.0));
            if j % self.rows == self.rows - 1 {
                row_values.sort_unstable_by(f32::total_cmp);
                let mid = row_values.len() / 2;
                let median = if row_values.len() % 2 == 1 {
                    row_values[mid]
                } else {
                    (row_values[mid - 1] + row_values[mid]) / 2.0
                };
                estimates.push(median);
                row_values.clear();
            }
        }
        estimates
    }

    /// The `k` coordinates with the largest estimated magnitude, the rest
    /// zero (FetchSGD's unsketching step).
    pub fn top_k(&self, table: &[f32], len: usize, k: usize) -> Vec<f32> {
        let mut estimates = self.estimate(table, len);
        if k < len {
            let mut order: Vec<usize> = (0..len).collect();
            order.select_nth_unstable_by(k, |&a, &b| estimates[b].abs().total_cmp(&estimates[a].abs()));
            for &i in &order[k..] {
                estimates[i] = 0.0;
            }
        }
        estimates
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vector(len: usize, seed: u64) -> Vec<f32> {
        let mut rng = ChaCha20Rng::seed_from_u64(seed);
        (0..len).map(|_| (rng.next_u32() as f32 / u32::MAX as f32) * 2.0 - 1.0).collect()
    }

    #[test]
    fn the_transform_matches_the_hadamard_matrix() {
        // H_4 = [[1,1,1,1],[1,-1,1,-1],[1,1,-1,-1],[1,-1,-1,1]].
        let mut x = [1.0f32, 2.0, 3.0, 4.0];
        walsh_hadamard(&mut x);
        assert_eq!(x, [10.0, -2.0, -4.0, 0.0]);
    }

    #[test]
    fn rotation_is_orthonormal_and_inverted_exactly() {
        let rotation = Rotation::new([7; 32], 256).unwrap();
        let x = vector(1000, 1);
        let y = rotation.forward(&x);
        // 1000 = 3 × 256 + 128 + 64 + 32 + 8: no padding.
        assert_eq!(y.len(), 1000);
        let blocks: Vec<usize> = rotation.blocks(1000).map(|(_, size)| size).collect();
        assert_eq!(blocks, [256, 256, 256, 128, 64, 32, 8]);
        let norm = |v: &[f32]| v.iter().map(|a| f64::from(*a).powi(2)).sum::<f64>().sqrt();
        assert!((norm(&x) - norm(&y)).abs() < 1e-3 * norm(&x));
        let back = rotation.inverse(&y, x.len());
        assert!(x.iter().zip(&back).all(|(a, b)| (a - b).abs() < 1e-5));
        assert!(Rotation::new([0; 32], 100).is_none());
        assert_ne!(Rotation::new([8; 32], 256).unwrap().forward(&x), y, "the seed picks the signs");
    }

    #[test]
    fn rotation_commutes_with_summation() {
        let rotation = Rotation::new([3; 32], 64).unwrap();
        let (a, b) = (vector(100, 2), vector(100, 3));
        let sum: Vec<f32> = a.iter().zip(&b).map(|(x, y)| x + y).collect();
        let rotated: Vec<f32> =
            rotation.forward(&a).iter().zip(rotation.forward(&b)).map(|(x, y)| x + y).collect();
        let back = rotation.inverse(&rotated, 100);
        assert!(sum.iter().zip(&back).all(|(x, y)| (x - y).abs() < 1e-5));
    }

    #[test]
    fn rotation_flattens_a_spiky_vector() {
        // One large coordinate among small ones: after rotation no
        // coordinate is much larger than the average, which is what lets a
        // fixed clipping range keep its precision.
        let mut x = vec![0.001f32; 4096];
        x[17] = 1.0;
        let y = Rotation::new([1; 32], 4096).unwrap().forward(&x);
        let peak = y.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let rms = (y.iter().map(|v| v * v).sum::<f32>() / y.len() as f32).sqrt();
        assert!(peak / rms < 2.0, "peak/rms {}", peak / rms);
    }

    #[test]
    fn the_sketch_is_linear_and_recovers_heavy_hitters() {
        let sketch = CountSketch::new([5; 32], 5, 200).unwrap();
        let (a, b) = (vector(5_000, 4), vector(5_000, 5));
        let summed: Vec<f32> = sketch.sketch(&a).iter().zip(sketch.sketch(&b)).map(|(x, y)| x + y).collect();
        let sum: Vec<f32> = a.iter().zip(&b).map(|(x, y)| x + y).collect();
        let direct = sketch.sketch(&sum);
        assert!(summed.iter().zip(&direct).all(|(x, y)| (x - y).abs() < 1e-3));
        // A sparse signal in light noise: the heavy coordinates come back.
        let mut signal: Vec<f32> = vector(5_000, 6).iter().map(|v| v * 0.01).collect();
        for (k, i) in [10usize, 999, 2_500, 4_321].iter().enumerate() {
            signal[*i] = 5.0 + k as f32;
        }
        let recovered = sketch.top_k(&sketch.sketch(&signal), signal.len(), 4);
        for i in [10usize, 999, 2_500, 4_321] {
            assert!(
                (recovered[i] - signal[i]).abs() < 0.2,
                "coordinate {i}: {} vs {}",
                recovered[i],
                signal[i]
            );
        }
        assert_eq!(recovered.iter().filter(|v| **v != 0.0).count(), 4);
    }
}
