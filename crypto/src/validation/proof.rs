//! The norm proof's prover, verifier and encoding (see the module above).

use curve25519_dalek::ristretto::{CompressedRistretto, RistrettoPoint};
use curve25519_dalek::scalar::Scalar;
use curve25519_dalek::traits::VartimeMultiscalarMul;
use rand_chacha::ChaCha20Rng;
use rand_core::{CryptoRng, Rng, SeedableRng};
use zeroize::Zeroizing;

use super::group::{Equations, Fiat, decompress, eq_table, random_scalar, scalar_i128, small_msm};
use super::{NormBound, PROBES, ValidationError, squares};

/// One sum-check round: commitments to the four coefficients of the round
/// polynomial and the blinding that opens g(0) + g(1) − claim to zero.
#[derive(Clone, PartialEq, Eq)]
struct Round {
    coefficients: [CompressedRistretto; 4],
    opening: Scalar,
}

/// A client's commitment to its input and its proof that ‖x‖₂ ≤ B.
#[derive(Clone, PartialEq, Eq)]
pub struct NormProof {
    rows: Vec<CompressedRistretto>,
    projections: Vec<i128>,
    rounds: Vec<Round>,
    evaluation: CompressedRistretto,
    square: [CompressedRistretto; 2],
    square_responses: [Scalar; 3],
    dot_mask: [CompressedRistretto; 2],
    dot_openings: [Scalar; 2],
    ipa: Vec<[CompressedRistretto; 2]>,
    ipa_last: Scalar,
}

impl std::fmt::Debug for NormProof {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NormProof").field("rows", &self.rows.len()).finish_non_exhaustive()
    }
}

/// A client's commitment to its input, decoded: the points of its input
/// rows, what [`check_sum`] adds up.
#[derive(Clone, PartialEq, Eq)]
pub struct Commitment(Vec<RistrettoPoint>);

impl std::fmt::Debug for Commitment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Commitment").field(&self.0.len()).finish()
    }
}

/// What [`prove`] hands back: the proof, and the blindings of the input-row
/// commitments, which the client masks and sends with its input so that
/// their sum can be unmasked with the input's sum.
pub struct Proven {
    /// The commitment and proof, to send.
    pub proof: NormProof,
    /// ρ_i of each input row (secret).
    pub blindings: Zeroizing<Vec<Scalar>>,
}

impl Commitment {
    /// The rows, compressed: 32 bytes each.
    pub fn to_bytes(&self) -> Vec<u8> {
        self.0.iter().flat_map(|row| row.compress().to_bytes()).collect()
    }

    /// Decodes [`to_bytes`](Self::to_bytes)'s encoding of `bound`'s input
    /// rows; refuses a wrong length or a string that is not a point.
    pub fn decode(bound: &NormBound, bytes: &[u8]) -> Result<Self, ValidationError> {
        if bytes.len() != 32 * bound.input_rows {
            return Err(ValidationError::Malformed("a commitment has the wrong number of rows"));
        }
        bytes
            .chunks_exact(32)
            .map(|chunk| {
                let mut row = [0u8; 32];
                row.copy_from_slice(chunk);
                decompress(&CompressedRistretto(row))
            })
            .collect::<Result<_, _>>()
            .map(Commitment)
    }

    /// The encoded length of a commitment to `bound`'s input rows.
    pub fn encoded_len(bound: &NormBound) -> usize {
        32 * bound.input_rows
    }
}

/// The row commitments C_i = Σ_j X_ij·G_j + ρ_i·H of `values` (of `bound`'s
/// dimension) under `blindings` (one per input row), with no proof: what a
/// verifier attests of a noise edge ([`super::noise`]).
pub(super) fn commit(
    bound: &NormBound,
    values: &[i64],
    blindings: &[Scalar],
) -> Result<Commitment, ValidationError> {
    if values.len() != bound.dimension || blindings.len() != bound.input_rows {
        return Err(ValidationError::Input("the committed vector has the wrong dimension"));
    }
    let mut row = Zeroizing::new(vec![0i128; bound.columns]);
    let rows = values
        .chunks(bound.columns)
        .zip(blindings)
        .map(|(chunk, blinding)| {
            row.iter_mut().for_each(|cell| *cell = 0);
            row.iter_mut().zip(chunk).for_each(|(cell, &v)| *cell = i128::from(v));
            commit_row(bound, &row, blinding)
        })
        .collect();
    Ok(Commitment(rows))
}

/// One row's commitment Σ_j X_ij·G_j + ρ_i·H (`row` has t cells).
fn commit_row(bound: &NormBound, row: &[i128], blinding: &Scalar) -> RistrettoPoint {
    small_msm(row, &bound.generators.columns) + bound.generators.h * blinding
}

impl NormProof {
    /// The commitment to the input, decoded (a proof verified with
    /// [`verify_each`] hands it back without decoding it again).
    pub fn commitment(&self, bound: &NormBound) -> Result<Commitment, ValidationError> {
        let rows = self.rows.get(..bound.input_rows).ok_or(ValidationError::Malformed("too few rows"))?;
        rows.iter().map(decompress).collect::<Result<_, _>>().map(Commitment)
    }

    /// The encoding: fixed-size fields in order, projections as 16-byte
    /// little-endian two's complement.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::new();
        let point = |out: &mut Vec<u8>, p: &CompressedRistretto| out.extend_from_slice(p.as_bytes());
        let scalar = |out: &mut Vec<u8>, s: &Scalar| out.extend_from_slice(s.as_bytes());
        self.rows.iter().for_each(|p| point(&mut out, p));
        self.projections.iter().for_each(|z| out.extend_from_slice(&z.to_le_bytes()));
        for round in &self.rounds {
            round.coefficients.iter().for_each(|p| point(&mut out, p));
            scalar(&mut out, &round.opening);
        }
        point(&mut out, &self.evaluation);
        self.square.iter().for_each(|p| point(&mut out, p));
        self.square_responses.iter().for_each(|s| scalar(&mut out, s));
        self.dot_mask.iter().for_each(|p| point(&mut out, p));
        self.dot_openings.iter().for_each(|s| scalar(&mut out, s));
        self.ipa.iter().flatten().for_each(|p| point(&mut out, p));
        scalar(&mut out, &self.ipa_last);
        out
    }

    /// Decodes a proof for `bound`: exact length, canonical scalars,
    /// projections within the honest range. Group elements are checked when
    /// the proof is verified.
    pub fn decode(bound: &NormBound, bytes: &[u8]) -> Result<Self, ValidationError> {
        if bytes.len() != encoded_len(bound) {
            return Err(ValidationError::Malformed("wrong length"));
        }
        let mut reader = Reader(bytes);
        let rows = (0..bound.committed_rows()).map(|_| reader.point()).collect();
        let limit = bound.projection_limit();
        let projections = (0..PROBES)
            .map(|_| {
                let z = i128::from_le_bytes(reader.take());
                if z.unsigned_abs() > limit {
                    Err(ValidationError::Malformed("a projection is out of range"))
                } else {
                    Ok(z)
                }
            })
            .collect::<Result<_, _>>()?;
        let rounds = (0..bound.rounds())
            .map(|_| {
                let coefficients = [reader.point(), reader.point(), reader.point(), reader.point()];
                Ok(Round { coefficients, opening: reader.scalar()? })
            })
            .collect::<Result<_, ValidationError>>()?;
        let evaluation = reader.point();
        let square = [reader.point(), reader.point()];
        let square_responses = [reader.scalar()?, reader.scalar()?, reader.scalar()?];
        let dot_mask = [reader.point(), reader.point()];
        let dot_openings = [reader.scalar()?, reader.scalar()?];
        let ipa = (0..bound.column_bits()).map(|_| [reader.point(), reader.point()]).collect();
        let ipa_last = reader.scalar()?;
        debug_assert!(reader.0.is_empty());
        Ok(Self {
            rows,
            projections,
            rounds,
            evaluation,
            square,
            square_responses,
            dot_mask,
            dot_openings,
            ipa,
            ipa_last,
        })
    }
}

pub(super) fn encoded_len(bound: &NormBound) -> usize {
    32 * bound.committed_rows()
        + 16 * PROBES
        + 160 * bound.rounds()
        + 32 * (1 + 2 + 3 + 2 + 2)
        + 64 * bound.column_bits()
        + 32
}

struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
    fn take<const N: usize>(&mut self) -> [u8; N] {
        let (head, rest) = self.0.split_at(N);
        self.0 = rest;
        let mut out = [0u8; N];
        out.copy_from_slice(head);
        out
    }

    fn point(&mut self) -> CompressedRistretto {
        CompressedRistretto(self.take())
    }

    fn scalar(&mut self) -> Result<Scalar, ValidationError> {
        Option::from(Scalar::from_canonical_bytes(self.take()))
            .ok_or(ValidationError::Malformed("a scalar is not reduced"))
    }
}

/// The probes: α_l over the input and squares rows, β_l over the columns.
struct Probes {
    alpha: Vec<i8>,
    beta: Vec<i8>,
    rows: usize,
    columns: usize,
}

impl Probes {
    fn draw(seed: [u8; 32], rows: usize, columns: usize) -> Self {
        let mut rng = ChaCha20Rng::from_seed(seed);
        let mut ternary = |len: usize| {
            let mut out = Vec::with_capacity(len);
            while out.len() < len {
                let mut word = rng.next_u64();
                for _ in 0..32.min(len - out.len()) {
                    // 00, 01 → 0; 10 → +1; 11 → −1.
                    out.push(match word & 3 {
                        2 => 1,
                        3 => -1,
                        _ => 0,
                    });
                    word >>= 2;
                }
            }
            out
        };
        let alpha = ternary(PROBES * rows);
        let beta = ternary(PROBES * columns);
        Self { alpha, beta, rows, columns }
    }

    fn alpha(&self, l: usize) -> &[i8] {
        &self.alpha[l * self.rows..(l + 1) * self.rows]
    }

    fn beta(&self, l: usize) -> &[i8] {
        &self.beta[l * self.columns..(l + 1) * self.columns]
    }
}

/// γ_l: 128-bit batching weights, each the pair of its 64-bit halves (so
/// that sums of ±halves over the probes fit an i128).
fn batching_weights(seed: [u8; 32]) -> Vec<[u64; 2]> {
    let mut rng = ChaCha20Rng::from_seed(seed);
    (0..PROBES).map(|_| [rng.next_u64(), rng.next_u64()]).collect()
}

/// γ as a field element: high·2^64 + low.
fn weight_scalar([high, low]: [u64; 2]) -> Scalar {
    Scalar::from((u128::from(high) << 64) | u128::from(low))
}

/// The columns of the last input row past the input (zero in an honest
/// commitment, and proven so: see the sum-check's claim).
fn padding_columns(bound: &NormBound) -> std::ops::Range<usize> {
    let used = bound.dimension - (bound.input_rows - 1) * bound.columns;
    used..bound.columns
}

/// ν^(j+1) for the padding columns j, the weights of their zero check.
fn padding_weights(bound: &NormBound, nu: Scalar) -> Vec<(usize, Scalar)> {
    let mut power = Scalar::ONE;
    padding_columns(bound)
        .map(|j| {
            power *= nu;
            (j, power)
        })
        .collect()
}

fn start_transcript(bound: &NormBound, context: &[u8]) -> Fiat {
    let mut fiat = Fiat::new(b"cohort/validation/v1/l2");
    fiat.bytes(b"context", context);
    fiat.u64(b"dimension", bound.dimension as u64);
    fiat.bytes(b"bound_sq", &bound.bound_sq.to_le_bytes());
    fiat.u64(b"columns", bound.columns as u64);
    fiat.u64(b"probes", PROBES as u64);
    fiat.u64(b"mask bits", u64::from(super::MASK_BITS));
    fiat
}

/// Coefficients of the cubic through (0, g0), (1, g1), (2, g2), (3, g3).
fn cubic_coefficients(g: [Scalar; 4]) -> [Scalar; 4] {
    let half = Scalar::from(2u8).invert();
    let third = Scalar::from(3u8).invert();
    let sixth = Scalar::from(6u8).invert();
    let d1 = g[1] - g[0];
    let d2 = g[2] - g[1] - g[1] + g[0];
    let d3 = g[3] - g[0] - Scalar::from(3u8) * (g[2] - g[1]);
    [g[0], d1 - d2 * half + d3 * third, (d2 - d3) * half, d3 * sixth]
}

fn powers(r: Scalar) -> [Scalar; 4] {
    [Scalar::ONE, r, r * r, r * r * r]
}

/// Commits to x (`values`, the quantized input as signed integers) and proves
/// ‖x‖₂² ≤ B². `context` binds the proof to its round and client.
pub fn prove<R: CryptoRng + ?Sized>(
    bound: &NormBound,
    context: &[u8],
    values: &[i64],
    rng: &mut R,
) -> Result<Proven, ValidationError> {
    if values.len() != bound.dimension {
        return Err(ValidationError::Input("the input has the wrong dimension"));
    }
    let over = ValidationError::Input("the input exceeds the norm bound");
    // Each |v| ≤ B < 2^50 and there are at most 2^24: the sum cannot overflow.
    if values.iter().any(|&v| u128::from(v.unsigned_abs()).pow(2) > bound.bound_sq) {
        return Err(over);
    }
    let norm_sq: u128 = values.iter().map(|&v| u128::from(v.unsigned_abs()).pow(2)).sum();
    if norm_sq > bound.bound_sq {
        return Err(over);
    }
    let rest = bound.bound_sq - norm_sq;
    let squares = squares::four_squares(rest);
    // A try is restarted with probability about k·2⁻⁴⁰; 16 restarts in a
    // row would mean a broken generator, not bad luck.
    for _ in 0..16 {
        if let Some(proven) = attempt(bound, context, values, squares, rng) {
            return Ok(proven);
        }
    }
    Err(ValidationError::Input("the projections kept falling outside their range"))
}

/// One try; `None` when a masked projection falls outside the range that
/// hides it (probability about k·2⁻⁴⁰), and the prover starts over.
fn attempt<R: CryptoRng + ?Sized>(
    bound: &NormBound,
    context: &[u8],
    values: &[i64],
    squares: [u128; 4],
    rng: &mut R,
) -> Option<Proven> {
    let t = bound.columns;
    let generators = &bound.generators;
    let cells = bound.padded_rows * t;

    // The matrix: input rows, the squares row, the mask rows, zero rows.
    let mut matrix = Zeroizing::new(vec![0i128; cells]);
    for (cell, &v) in matrix.iter_mut().zip(values) {
        *cell = i128::from(v);
    }
    let squares_at = bound.squares_row() * t;
    for (k, &s) in squares.iter().enumerate() {
        matrix[squares_at + k] = s as i128;
    }
    let mask_at = bound.first_mask_row() * t;
    let span = 2 * bound.mask_bound + 1;
    let span_bits = 128 - span.leading_zeros();
    for cell in &mut matrix[mask_at..mask_at + PROBES] {
        *cell = loop {
            let draw = ((u128::from(rng.next_u64()) << 64) | u128::from(rng.next_u64())) >> (128 - span_bits);
            if draw < span {
                break draw as i128 - bound.mask_bound as i128;
            }
        };
    }

    // Row commitments.
    let blindings: Zeroizing<Vec<Scalar>> =
        Zeroizing::new((0..bound.committed_rows()).map(|_| random_scalar(rng)).collect());
    let row_points: Vec<RistrettoPoint> = (0..bound.committed_rows())
        .map(|i| commit_row(bound, &matrix[i * t..(i + 1) * t], &blindings[i]))
        .collect();
    let rows: Vec<CompressedRistretto> = row_points.iter().map(RistrettoPoint::compress).collect();
    let mut fiat = start_transcript(bound, context);
    rows.iter().for_each(|p| fiat.point(b"row", p));

    // Projections, masked and rejection-sampled.
    let probe_rows = bound.input_rows + 1;
    let probes = Probes::draw(fiat.seed(b"probes"), probe_rows, t);
    let mut projections = Vec::with_capacity(PROBES);
    for l in 0..PROBES {
        let beta = probes.beta(l);
        let mut z = matrix[mask_at + l];
        for (i, &a) in probes.alpha(l).iter().enumerate() {
            if a != 0 {
                let row = &matrix[i * t..(i + 1) * t];
                let dot: i128 = row.iter().zip(beta).map(|(&x, &b)| x * i128::from(b)).sum();
                z += i128::from(a) * dot;
            }
        }
        if z.unsigned_abs() > bound.projection_limit() {
            return None;
        }
        projections.push(z);
    }
    projections.iter().for_each(|z| fiat.bytes(b"projection", &z.to_le_bytes()));
    let gamma = batching_weights(fiat.seed(b"batching"));
    let mu = fiat.challenge(b"mu");
    let nu = fiat.challenge(b"nu");

    // The tables of the sum-check: x, μ·A and σ over all S·t cells.
    let mut x: Zeroizing<Vec<Scalar>> = Zeroizing::new(matrix.iter().map(|&v| scalar_i128(v)).collect());
    let mut a = vec![Scalar::ZERO; cells];
    {
        // A = Σ_l γ_l·α_l⊗β_l, each γ_l in two 64-bit halves so that the
        // row sums stay exact in i128 (|Σ| ≤ k·2^64).
        let two_64 = Scalar::from(1u128 << 64);
        let halves: [Vec<i128>; 2] = std::array::from_fn(|half| {
            (0..PROBES)
                .flat_map(|l| {
                    let g = i128::from(gamma[l][half]);
                    probes.beta(l).iter().map(move |&b| g * i128::from(b))
                })
                .collect()
        });
        let mut row_sums = [vec![0i128; t], vec![0i128; t]];
        for i in 0..probe_rows {
            for (row_sum, weighted) in row_sums.iter_mut().zip(&halves) {
                row_sum.iter_mut().for_each(|v| *v = 0);
                for l in 0..PROBES {
                    let sign = probes.alpha(l)[i];
                    if sign != 0 {
                        let w = &weighted[l * t..(l + 1) * t];
                        if sign > 0 {
                            row_sum.iter_mut().zip(w).for_each(|(s, &w)| *s += w);
                        } else {
                            row_sum.iter_mut().zip(w).for_each(|(s, &w)| *s -= w);
                        }
                    }
                }
            }
            for (j, cell) in a[i * t..(i + 1) * t].iter_mut().enumerate() {
                *cell = mu * (scalar_i128(row_sums[0][j]) * two_64 + scalar_i128(row_sums[1][j]));
            }
        }
        for (l, &g) in gamma.iter().enumerate() {
            a[mask_at + l] = mu * weight_scalar(g);
        }
        let last = (bound.input_rows - 1) * t;
        for (j, weight) in padding_weights(bound, nu) {
            a[last + j] += mu * weight;
        }
    }
    let mask_rows = bound.first_mask_row()..bound.committed_rows();
    let mut sigma: Vec<Scalar> =
        (0..cells).map(|c| if mask_rows.contains(&(c / t)) { Scalar::ZERO } else { Scalar::ONE }).collect();

    // Sum-check.
    let mut rounds = Vec::with_capacity(bound.rounds());
    let mut challenges = Vec::with_capacity(bound.rounds());
    let mut previous_blinding = Scalar::ZERO;
    for _ in 0..bound.rounds() {
        let half = x.len() / 2;
        let mut g = [Scalar::ZERO; 4];
        for p in 0..half {
            let (x0, x1) = (x[2 * p], x[2 * p + 1]);
            let (a0, a1) = (a[2 * p], a[2 * p + 1]);
            let (s0, s1) = (sigma[2 * p], sigma[2 * p + 1]);
            let (dx, da, ds) = (x1 - x0, a1 - a0, s1 - s0);
            let (x2, a2, s2) = (x1 + dx, a1 + da, s1 + ds);
            let (x3, a3, s3) = (x2 + dx, a2 + da, s2 + ds);
            g[0] += x0 * (s0 * x0 + a0);
            g[1] += x1 * (s1 * x1 + a1);
            g[2] += x2 * (s2 * x2 + a2);
            g[3] += x3 * (s3 * x3 + a3);
        }
        let coefficients = cubic_coefficients(g);
        let kappa = [random_scalar(rng), random_scalar(rng), random_scalar(rng), random_scalar(rng)];
        let commitments: [CompressedRistretto; 4] = std::array::from_fn(|d| {
            RistrettoPoint::vartime_multiscalar_mul([coefficients[d], kappa[d]], [generators.v, generators.h])
                .compress()
        });
        let two = Scalar::from(2u8);
        let opening = two * kappa[0] + kappa[1] + kappa[2] + kappa[3] - previous_blinding;
        commitments.iter().for_each(|p| fiat.point(b"coefficient", p));
        fiat.scalar(b"opening", &opening);
        let r = fiat.challenge(b"r");
        let rp = powers(r);
        previous_blinding = (0..4).map(|d| rp[d] * kappa[d]).sum();
        rounds.push(Round { coefficients: commitments, opening });
        challenges.push(r);
        for table in [&mut x, &mut a, &mut sigma] {
            for p in 0..half {
                let (lo, hi) = (table[2 * p], table[2 * p + 1]);
                table[p] = lo + r * (hi - lo);
            }
            table.truncate(half);
        }
    }
    let (e, a_r, s_r) = (x[0], a[0], sigma[0]);
    let final_blinding = previous_blinding;

    // The evaluation e = X̃(r) and the square: last claim − Ã·E opens to σ̃·e².
    let epsilon = random_scalar(rng);
    let evaluation = RistrettoPoint::vartime_multiscalar_mul([e, epsilon], [generators.v, generators.h]);
    let evaluation_c = evaluation.compress();
    fiat.point(b"evaluation", &evaluation_c);
    let scaled = evaluation * s_r;
    let tau = final_blinding - a_r * epsilon - e * s_r * epsilon;
    let (ka, kb, kd) = (random_scalar(rng), random_scalar(rng), random_scalar(rng));
    let square = [
        RistrettoPoint::vartime_multiscalar_mul([ka, kb], [generators.v, generators.h]).compress(),
        RistrettoPoint::vartime_multiscalar_mul([ka, kd], [scaled, generators.h]).compress(),
    ];
    square.iter().for_each(|p| fiat.point(b"square", p));
    let c = fiat.challenge(b"square challenge");
    let square_responses = [ka + c * e, kb + c * epsilon, kd + c * tau];
    square_responses.iter().for_each(|s| fiat.scalar(b"square response", s));

    // The dot product e = ⟨w, eq(r_col)⟩, w = Σ_i eq(r_row, i)·X_i.
    let (r_col, r_row) = challenges.split_at(bound.column_bits());
    let eq_col = eq_table(r_col);
    let eq_row = eq_table(r_row);
    let mut w = Zeroizing::new(vec![Scalar::ZERO; t]);
    let mut omega = Scalar::ZERO;
    for i in 0..bound.committed_rows() {
        for (wj, &v) in w.iter_mut().zip(&matrix[i * t..(i + 1) * t]) {
            if v != 0 {
                *wj += eq_row[i] * scalar_i128(v);
            }
        }
        omega += eq_row[i] * blindings[i];
    }
    let d: Zeroizing<Vec<Scalar>> = Zeroizing::new((0..t).map(|_| random_scalar(rng)).collect());
    let (delta_d, delta_v) = (random_scalar(rng), random_scalar(rng));
    let d_value: Scalar = d.iter().zip(&eq_col).map(|(d, e)| d * e).sum();
    let dot_mask = [
        RistrettoPoint::vartime_multiscalar_mul(
            d.iter().chain([&delta_d]),
            generators.columns.iter().chain([&generators.h]),
        )
        .compress(),
        RistrettoPoint::vartime_multiscalar_mul([d_value, delta_v], [generators.v, generators.h]).compress(),
    ];
    dot_mask.iter().for_each(|p| fiat.point(b"dot mask", p));
    let c2 = fiat.challenge(b"dot challenge");
    let dot_openings = [c2 * omega + delta_d, c2 * epsilon + delta_v];
    dot_openings.iter().for_each(|s| fiat.scalar(b"dot opening", s));
    let h = fiat.challenge(b"ipa base");
    let u = generators.v * h;
    let masked: Vec<Scalar> = w.iter().zip(d.iter()).map(|(w, d)| c2 * w + d).collect();
    let (ipa, ipa_last) = inner_product(&mut fiat, masked, eq_col, generators.columns.clone(), u);

    Some(Proven {
        proof: NormProof {
            rows,
            projections,
            rounds,
            evaluation: evaluation_c,
            square,
            square_responses,
            dot_mask,
            dot_openings,
            ipa,
            ipa_last,
        },
        blindings: Zeroizing::new(blindings[..bound.input_rows].to_vec()),
    })
}

/// Bulletproofs' inner-product argument for P = ⟨w, G⟩ + ⟨w, b⟩·U with b
/// public: log₂ t rounds of (L, R), then the last scalar.
fn inner_product(
    fiat: &mut Fiat,
    mut w: Vec<Scalar>,
    mut b: Vec<Scalar>,
    mut g: Vec<RistrettoPoint>,
    u: RistrettoPoint,
) -> (Vec<[CompressedRistretto; 2]>, Scalar) {
    let mut rounds = Vec::new();
    while w.len() > 1 {
        let half = w.len() / 2;
        let (w_lo, w_hi) = w.split_at(half);
        let (b_lo, b_hi) = b.split_at(half);
        let (g_lo, g_hi) = g.split_at(half);
        let cross = |w: &[Scalar], b: &[Scalar]| w.iter().zip(b).map(|(w, b)| w * b).sum::<Scalar>();
        let l = RistrettoPoint::vartime_multiscalar_mul(
            w_lo.iter().copied().chain([cross(w_lo, b_hi)]),
            g_hi.iter().chain([&u]),
        )
        .compress();
        let r = RistrettoPoint::vartime_multiscalar_mul(
            w_hi.iter().copied().chain([cross(w_hi, b_lo)]),
            g_lo.iter().chain([&u]),
        )
        .compress();
        fiat.point(b"L", &l);
        fiat.point(b"R", &r);
        let x = fiat.nonzero_challenge(b"x");
        let x_inv = x.invert();
        let w_next: Vec<Scalar> = (0..half).map(|i| w_lo[i] * x + w_hi[i] * x_inv).collect();
        let b_next: Vec<Scalar> = (0..half).map(|i| b_lo[i] * x_inv + b_hi[i] * x).collect();
        let g_next: Vec<RistrettoPoint> = (0..half)
            .map(|i| RistrettoPoint::vartime_multiscalar_mul([x_inv, x], [g_lo[i], g_hi[i]]))
            .collect();
        rounds.push([l, r]);
        (w, b, g) = (w_next, b_next, g_next);
    }
    fiat.scalar(b"ipa last", &w[0]);
    (rounds, w[0])
}

/// Verifies one proof for `context` (see [`verify_batch`] for many).
pub fn verify<R: CryptoRng + ?Sized>(
    bound: &NormBound,
    context: &[u8],
    proof: &NormProof,
    rng: &mut R,
) -> Result<(), ValidationError> {
    let mut equations = Equations::new(bound.columns);
    add_equations(bound, context, proof, &mut equations, rng)?;
    if equations.hold(bound.generators.as_ref()) {
        Ok(())
    } else {
        Err(ValidationError::Rejected("the proof does not verify"))
    }
}

/// Verifies many proofs with one multiscalar multiplication; when that fails,
/// each proof on its own, to name the ones that are wrong. Returns the
/// indices of the proofs refused.
pub fn verify_batch<R: CryptoRng + ?Sized>(
    bound: &NormBound,
    items: &[(&[u8], &NormProof)],
    rng: &mut R,
) -> Vec<usize> {
    let verified = verify_each(bound, items, rng);
    verified.iter().enumerate().filter(|(_, c)| c.is_none()).map(|(index, _)| index).collect()
}

/// [`verify_batch`], handing back each accepted proof's commitment (`None`
/// for a refused one), decoded once for the verification and the sum check.
pub fn verify_each<R: CryptoRng + ?Sized>(
    bound: &NormBound,
    items: &[(&[u8], &NormProof)],
    rng: &mut R,
) -> Vec<Option<Commitment>> {
    // Each proof's equations get their weights from a generator of its own,
    // seeded from `rng`, so that they can be formed on several threads.
    let seeds: Vec<[u8; 32]> = items
        .iter()
        .map(|_| {
            let mut seed = [0u8; 32];
            rng.fill_bytes(&mut seed);
            seed
        })
        .collect();
    let replay = |index: usize| {
        let (context, proof) = items[index];
        let mut own = Equations::new(bound.columns);
        let mut rng = ChaCha20Rng::from_seed(seeds[index]);
        add_equations(bound, context, proof, &mut own, &mut rng).ok().map(|commitment| (commitment, own))
    };
    #[cfg(feature = "parallel")]
    let replayed: Vec<Option<(Commitment, Equations)>> = {
        use rayon::prelude::*;
        (0..items.len()).into_par_iter().map(replay).collect()
    };
    #[cfg(not(feature = "parallel"))]
    let replayed: Vec<Option<(Commitment, Equations)>> = (0..items.len()).map(replay).collect();
    let mut refused: Vec<bool> = replayed.iter().map(Option::is_none).collect();
    let mut commitments = Vec::with_capacity(items.len());
    let mut sets = Vec::with_capacity(items.len());
    for (index, replayed) in replayed.into_iter().enumerate() {
        match replayed {
            Some((commitment, equations)) => {
                commitments.push(Some(commitment));
                sets.push((index, equations));
            }
            None => commitments.push(None),
        }
    }
    // One check per thread's share of the proofs (each share must hold on
    // its own, which is as sound as one check of all).
    #[cfg(feature = "parallel")]
    {
        use rayon::prelude::*;
        let share = sets.len().div_ceil(rayon::current_num_threads()).max(1);
        let failed: Vec<Vec<usize>> = sets
            .par_chunks(share)
            .map(|chunk| {
                let mut refused = vec![false; items.len()];
                bisect(bound, chunk, &mut refused);
                refused.iter().enumerate().filter(|(_, r)| **r).map(|(i, _)| i).collect()
            })
            .collect();
        failed.into_iter().flatten().for_each(|index| refused[index] = true);
    }
    #[cfg(not(feature = "parallel"))]
    bisect(bound, &sets, &mut refused);
    for (commitment, refused) in commitments.iter_mut().zip(refused) {
        if refused {
            *commitment = None;
        }
    }
    commitments
}

/// Checks the proofs' equations together; when they fail, each half on its
/// own, down to the proofs that fail alone: about 2·log₂ n multiplications
/// per bad proof instead of n.
fn bisect(bound: &NormBound, sets: &[(usize, Equations)], refused: &mut [bool]) {
    let Some((first, _)) = sets.first() else {
        return;
    };
    let mut all = Equations::new(bound.columns);
    sets.iter().for_each(|(_, equations)| all.absorb(equations));
    if all.hold(bound.generators.as_ref()) {
        return;
    }
    if sets.len() == 1 {
        refused[*first] = true;
        return;
    }
    let (left, right) = sets.split_at(sets.len() / 2);
    bisect(bound, left, refused);
    bisect(bound, right, refused);
}

/// Replays the transcript and adds the proof's group equations, each with a
/// random weight; structural failures (a point that does not decode, a
/// projection out of range) return at once.
fn add_equations<R: CryptoRng + ?Sized>(
    bound: &NormBound,
    context: &[u8],
    proof: &NormProof,
    eqs: &mut Equations,
    rng: &mut R,
) -> Result<Commitment, ValidationError> {
    let t = bound.columns;
    if proof.rows.len() != bound.committed_rows()
        || proof.projections.len() != PROBES
        || proof.rounds.len() != bound.rounds()
        || proof.ipa.len() != bound.column_bits()
    {
        return Err(ValidationError::Malformed("the proof has the wrong shape for this bound"));
    }
    let limit = bound.projection_limit();
    if proof.projections.iter().any(|z| z.unsigned_abs() > limit) {
        return Err(ValidationError::Malformed("a projection is out of range"));
    }
    let rows: Vec<RistrettoPoint> = proof.rows.iter().map(decompress).collect::<Result<_, _>>()?;
    let mut fiat = start_transcript(bound, context);
    proof.rows.iter().for_each(|p| fiat.point(b"row", p));
    let probe_rows = bound.input_rows + 1;
    let probes = Probes::draw(fiat.seed(b"probes"), probe_rows, t);
    proof.projections.iter().for_each(|z| fiat.bytes(b"projection", &z.to_le_bytes()));
    let gamma = batching_weights(fiat.seed(b"batching"));
    let mu = fiat.challenge(b"mu");
    let nu = fiat.challenge(b"nu");
    let claim = Scalar::from(bound.bound_sq)
        + mu * proof
            .projections
            .iter()
            .zip(&gamma)
            .map(|(&z, &g)| scalar_i128(z) * weight_scalar(g))
            .sum::<Scalar>();

    // Sum-check rounds: 2K0 + K1 + K2 + K3 − previous − opening·H = 0.
    let mut previous: Vec<(Scalar, RistrettoPoint)> = vec![(claim, bound.generators.v)];
    let mut challenges = Vec::with_capacity(bound.rounds());
    for round in &proof.rounds {
        let k: Vec<RistrettoPoint> = round.coefficients.iter().map(decompress).collect::<Result<_, _>>()?;
        round.coefficients.iter().for_each(|p| fiat.point(b"coefficient", p));
        fiat.scalar(b"opening", &round.opening);
        let weight = random_scalar(rng);
        let two = Scalar::from(2u8);
        for (d, point) in k.iter().enumerate() {
            eqs.term(weight * if d == 0 { two } else { Scalar::ONE }, *point);
        }
        for (s, p) in &previous {
            eqs.term(-weight * s, *p);
        }
        eqs.h -= weight * round.opening;
        let r = fiat.challenge(b"r");
        let rp = powers(r);
        previous = k.iter().zip(rp).map(|(p, s)| (s, *p)).collect();
        challenges.push(r);
    }

    // σ̃(r) and μ·Ã(r) from the probes.
    let (r_col, r_row) = challenges.split_at(bound.column_bits());
    let eq_col = eq_table(r_col);
    let eq_row = eq_table(r_row);
    let s_r =
        Scalar::ONE - (bound.first_mask_row()..bound.committed_rows()).map(|i| eq_row[i]).sum::<Scalar>();
    let mut a_r = Scalar::ZERO;
    for (l, &g) in gamma.iter().enumerate() {
        let signed_sum = |signs: &[i8], weights: &[Scalar]| {
            let (mut plus, mut minus) = (Scalar::ZERO, Scalar::ZERO);
            for (&s, w) in signs.iter().zip(weights) {
                match s {
                    1 => plus += w,
                    -1 => minus += w,
                    _ => {}
                }
            }
            plus - minus
        };
        let at = bound.first_mask_row() * t + l;
        a_r += weight_scalar(g)
            * (signed_sum(probes.alpha(l), &eq_row) * signed_sum(probes.beta(l), &eq_col)
                + eq_row[at / t] * eq_col[at % t]);
    }
    let padding: Scalar = padding_weights(bound, nu).into_iter().map(|(j, w)| w * eq_col[j]).sum();
    a_r += eq_row[bound.input_rows - 1] * padding;
    let a_r = mu * a_r;

    // The square: z1·V + z2·H − A1 − c·E = 0 and
    // z1·σ̃·E + z3·H − A2 − c·(F − μÃ·E) = 0, F = Σ_d r^d·K_d of the last round.
    let evaluation = decompress(&proof.evaluation)?;
    fiat.point(b"evaluation", &proof.evaluation);
    let [a1, a2] = [decompress(&proof.square[0])?, decompress(&proof.square[1])?];
    proof.square.iter().for_each(|p| fiat.point(b"square", p));
    let c = fiat.challenge(b"square challenge");
    proof.square_responses.iter().for_each(|s| fiat.scalar(b"square response", s));
    let [z1, z2, z3] = proof.square_responses;
    let weight = random_scalar(rng);
    eqs.v += weight * z1;
    eqs.h += weight * z2;
    eqs.term(-weight, a1);
    eqs.term(-weight * c, evaluation);
    let weight = random_scalar(rng);
    eqs.term(weight * (z1 * s_r + c * a_r), evaluation);
    eqs.h += weight * z3;
    eqs.term(-weight, a2);
    for (s, p) in &previous {
        eqs.term(-weight * c * s, *p);
    }

    // The dot product: c2·W + D − τ1·H + h·(c2·E + Dv − τ2·H)
    //   + Σ (x²·L + x⁻²·R) − a·Σ s_i·G_i − a·⟨s, b⟩·h·V = 0.
    let [dm, dv] = [decompress(&proof.dot_mask[0])?, decompress(&proof.dot_mask[1])?];
    proof.dot_mask.iter().for_each(|p| fiat.point(b"dot mask", p));
    let c2 = fiat.challenge(b"dot challenge");
    proof.dot_openings.iter().for_each(|s| fiat.scalar(b"dot opening", s));
    let h = fiat.challenge(b"ipa base");
    let weight = random_scalar(rng);
    for (i, row) in rows.iter().enumerate() {
        eqs.term(weight * c2 * eq_row[i], *row);
    }
    eqs.term(weight, dm);
    eqs.term(weight * h * c2, evaluation);
    eqs.term(weight * h, dv);
    eqs.h -= weight * (proof.dot_openings[0] + h * proof.dot_openings[1]);
    let mut xs = Vec::with_capacity(proof.ipa.len());
    for [l, r] in &proof.ipa {
        let (lp, rp) = (decompress(l)?, decompress(r)?);
        fiat.point(b"L", l);
        fiat.point(b"R", r);
        let x = fiat.nonzero_challenge(b"x");
        let x_inv = x.invert();
        eqs.term(weight * x * x, lp);
        eqs.term(weight * x_inv * x_inv, rp);
        xs.push((x, x_inv));
    }
    fiat.scalar(b"ipa last", &proof.ipa_last);
    let mut s = vec![Scalar::ONE];
    for (x, x_inv) in &xs {
        s = s.iter().flat_map(|v| [v * x_inv, v * x]).collect();
    }
    let b_last: Scalar = s.iter().zip(&eq_col).map(|(s, b)| s * b).sum();
    for (coefficient, s_i) in eqs.columns.iter_mut().zip(&s) {
        *coefficient -= weight * proof.ipa_last * s_i;
    }
    eqs.v -= weight * proof.ipa_last * b_last * h;
    Ok(Commitment(rows[..bound.input_rows].to_vec()))
}

/// The coordinator's check that the unmasked sum is the sum of what was
/// committed: Σ_u C_(u,i) = Σ_j sum_ij·G_j + (Σ_u ρ_(u,i))·H for every input
/// row i, checked at once under random weights. `commitments` are the
/// counted clients', `sum` the integer sum of their inputs, `blinding_sum`
/// the unmasked sum of their row blindings. The rows are added up first
/// (one addition per client and row), then one multiplication checks them.
pub fn check_sum<R: CryptoRng + ?Sized>(
    bound: &NormBound,
    commitments: &[&Commitment],
    sum: &[i128],
    blinding_sum: &[Scalar],
    rng: &mut R,
) -> Result<(), ValidationError> {
    let t = bound.columns;
    if sum.len() != bound.dimension || blinding_sum.len() != bound.input_rows {
        return Err(ValidationError::Malformed("the sum has the wrong dimension"));
    }
    if commitments.iter().any(|c| c.0.len() != bound.input_rows) {
        return Err(ValidationError::Malformed("a client's commitment has the wrong number of rows"));
    }
    let mut eqs = Equations::new(t);
    for i in 0..bound.input_rows {
        let weight = random_scalar(rng);
        let row: RistrettoPoint = commitments.iter().map(|c| c.0[i]).sum();
        eqs.term(weight, row);
        let values = &sum[i * t..((i + 1) * t).min(sum.len())];
        for (coefficient, &v) in eqs.columns.iter_mut().zip(values) {
            *coefficient -= weight * scalar_i128(v);
        }
        eqs.h -= weight * blinding_sum[i];
    }
    if eqs.hold(bound.generators.as_ref()) {
        Ok(())
    } else {
        Err(ValidationError::Rejected("the unmasked sum does not open the sum of the commitments"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rng(seed: u8) -> ChaCha20Rng {
        ChaCha20Rng::from_seed([seed; 32])
    }

    /// A vector of `m` integers in [−range, range] and its squared norm.
    fn input(m: usize, range: i64, seed: u8) -> (Vec<i64>, u64) {
        let mut r = rng(seed);
        let values: Vec<i64> =
            (0..m).map(|_| (r.next_u64() % (2 * range as u64 + 1)) as i64 - range).collect();
        let norm_sq = values.iter().map(|v| (v * v) as u64).sum();
        (values, norm_sq)
    }

    fn proven(bound: &NormBound, context: &[u8], values: &[i64], seed: u8) -> Proven {
        prove(bound, context, values, &mut rng(seed)).expect("an honest input proves")
    }

    #[test]
    fn honest_proofs_verify_at_and_below_the_bound() {
        for (m, range) in [(1, 3), (10, 100), (300, 255), (5_000, 127)] {
            let (values, norm_sq) = input(m, range, m as u8);
            for bound_sq in [norm_sq.max(1), norm_sq + 1, norm_sq * 3 + 17] {
                let bound = NormBound::new(m, u128::from(bound_sq)).unwrap();
                let proof = proven(&bound, b"round 1 client 7", &values, 1).proof;
                assert_eq!(
                    verify(&bound, b"round 1 client 7", &proof, &mut rng(2)),
                    Ok(()),
                    "m {m}, B² {bound_sq}"
                );
            }
        }
    }

    #[test]
    fn the_encoding_round_trips_and_has_the_stated_length() {
        let (values, norm_sq) = input(1000, 200, 3);
        let bound = NormBound::new(1000, u128::from(norm_sq)).unwrap();
        let proof = proven(&bound, b"c", &values, 4).proof;
        let bytes = proof.to_bytes();
        assert_eq!(bytes.len(), bound.proof_len());
        let decoded = NormProof::decode(&bound, &bytes).unwrap();
        assert_eq!(decoded, proof);
        assert_eq!(verify(&bound, b"c", &decoded, &mut rng(5)), Ok(()));
        assert!(NormProof::decode(&bound, &bytes[1..]).is_err());
        let other = NormBound::new(1001, u128::from(norm_sq)).unwrap();
        assert!(NormProof::decode(&other, &bytes).is_err() || other.proof_len() == bytes.len());
    }

    #[test]
    fn the_prover_refuses_an_input_over_the_bound() {
        let (values, norm_sq) = input(64, 50, 6);
        let bound = NormBound::new(64, u128::from(norm_sq - 1)).unwrap();
        assert!(matches!(prove(&bound, b"c", &values, &mut rng(7)), Err(ValidationError::Input(_))));
        assert!(matches!(prove(&bound, b"c", &values[1..], &mut rng(7)), Err(ValidationError::Input(_))));
    }

    #[test]
    fn every_changed_byte_of_a_proof_is_refused() {
        let (values, norm_sq) = input(200, 60, 8);
        let bound = NormBound::new(200, u128::from(norm_sq)).unwrap();
        let bytes = proven(&bound, b"c", &values, 9).proof.to_bytes();
        // One byte in every 32-byte field, whatever it is.
        for at in (0..bytes.len()).step_by(29) {
            let mut forged = bytes.clone();
            forged[at] ^= 0x10;
            let refused = match NormProof::decode(&bound, &forged) {
                Err(_) => true,
                Ok(proof) => verify(&bound, b"c", &proof, &mut rng(10)).is_err(),
            };
            assert!(refused, "a change at byte {at} of {} passed", bytes.len());
        }
    }

    #[test]
    fn a_proof_is_bound_to_its_context_and_its_bound() {
        let (values, norm_sq) = input(100, 30, 11);
        let bound = NormBound::new(100, u128::from(norm_sq)).unwrap();
        let proof = proven(&bound, b"round 4 client 2", &values, 12).proof;
        assert!(
            verify(&bound, b"round 5 client 2", &proof, &mut rng(13)).is_err(),
            "replayed in another round"
        );
        assert!(
            verify(&bound, b"round 4 client 3", &proof, &mut rng(13)).is_err(),
            "claimed by another client"
        );
        let looser = NormBound::new(100, u128::from(norm_sq + 1000)).unwrap();
        assert!(verify(&looser, b"round 4 client 2", &proof, &mut rng(13)).is_err());
    }

    #[test]
    fn a_lie_about_the_squares_does_not_verify() {
        // The prover's sum-check then starts from a sum that is not B² (3² + 1² = 10 would be honest).
        let (values, norm_sq) = input(100, 30, 14);
        let bound = NormBound::new(100, u128::from(norm_sq + 10)).unwrap();
        for squares in [[3, 0, 0, 0], [3, 1, 1, 0], [0, 0, 0, 0]] {
            let proven = (0..).find_map(|_| attempt(&bound, b"c", &values, squares, &mut rng(15))).unwrap();
            let refused = verify(&bound, b"c", &proven.proof, &mut rng(16));
            assert_eq!(refused, Err(ValidationError::Rejected("the proof does not verify")), "{squares:?}");
        }
        // Over the bound, the rest B² − ‖x‖² is negative: no integer squares exist.
        let over = NormBound::new(100, u128::from(norm_sq - 1)).unwrap();
        let proven = (0..).find_map(|_| attempt(&over, b"c", &values, [0; 4], &mut rng(17))).unwrap();
        assert!(verify(&over, b"c", &proven.proof, &mut rng(18)).is_err());
    }

    #[test]
    fn a_batch_names_exactly_the_proofs_that_fail() {
        let bound = NormBound::new(300, 300 * 40 * 40).unwrap();
        let contexts: Vec<Vec<u8>> = (0..6).map(|u| format!("client {u}").into_bytes()).collect();
        let mut proofs: Vec<NormProof> = (0..6)
            .map(|u| proven(&bound, &contexts[u], &input(300, 40, 20 + u as u8).0, 30 + u as u8).proof)
            .collect();
        fn items<'a>(contexts: &'a [Vec<u8>], proofs: &'a [NormProof]) -> Vec<(&'a [u8], &'a NormProof)> {
            contexts.iter().map(Vec::as_slice).zip(proofs).collect()
        }
        assert!(verify_batch(&bound, &items(&contexts, &proofs), &mut rng(40)).is_empty());
        proofs.swap(1, 4); // each is now presented under the other's context
        proofs[2].ipa_last += Scalar::ONE;
        assert_eq!(verify_batch(&bound, &items(&contexts, &proofs), &mut rng(41)), vec![1, 2, 4]);
    }

    #[test]
    fn the_sum_opens_the_commitments_and_nothing_else_does() {
        let m = 700;
        let bound = NormBound::new(m, u128::from(m as u64 * 100 * 100)).unwrap();
        let inputs: Vec<Vec<i64>> = (0..4).map(|u| input(m, 100, 50 + u).0).collect();
        let proven: Vec<Proven> =
            inputs.iter().enumerate().map(|(u, x)| proven(&bound, b"c", x, 60 + u as u8)).collect();
        let commitments: Vec<Commitment> =
            proven.iter().map(|p| p.proof.commitment(&bound).unwrap()).collect();
        let rows: Vec<&Commitment> = commitments.iter().collect();
        let sum: Vec<i128> = (0..m).map(|j| inputs.iter().map(|x| i128::from(x[j])).sum()).collect();
        let blinding_sum: Vec<Scalar> =
            (0..bound.input_rows()).map(|i| proven.iter().map(|p| p.blindings[i]).sum()).collect();
        assert_eq!(check_sum(&bound, &rows, &sum, &blinding_sum, &mut rng(70)), Ok(()));

        // A client that masked another vector than it committed to: the sum
        // moves by the difference, and no longer opens the commitments.
        let mut moved = sum.clone();
        moved[m - 1] += 1;
        assert!(check_sum(&bound, &rows, &moved, &blinding_sum, &mut rng(71)).is_err());
        // A vector with its mass moved between rows (same total) is caught too.
        let mut shifted = sum.clone();
        shifted[0] += 5;
        shifted[m - 1] -= 5;
        assert!(check_sum(&bound, &rows, &shifted, &blinding_sum, &mut rng(72)).is_err());
        // Leaving a client out of the commitments, or the blindings, fails.
        assert!(check_sum(&bound, &rows[1..], &sum, &blinding_sum, &mut rng(73)).is_err());
        let mut blinding = blinding_sum.clone();
        blinding[0] += Scalar::ONE;
        assert!(check_sum(&bound, &rows, &sum, &blinding, &mut rng(74)).is_err());
    }

    #[test]
    fn values_in_the_padding_of_the_last_row_do_not_verify() {
        // The sum check has no entry past the input, so a commitment with
        // something there could not open the unmasked sum: the proof shows
        // those cells are zero, even when their squares fit the bound.
        let m = 100; // 16 columns: the last input row uses 4 of them
        let (mut values, norm_sq) = input(m, 20, 19);
        let bound = NormBound::new(m, u128::from(norm_sq + 9)).unwrap();
        assert!(!padding_columns(&bound).is_empty());
        values.push(3); // 3² = 9: the norm is exactly B²
        let proven = (0..).find_map(|_| attempt(&bound, b"c", &values, [0; 4], &mut rng(20))).unwrap();
        assert!(verify(&bound, b"c", &proven.proof, &mut rng(21)).is_err());
        values.pop();
        let honest = (0..).find_map(|_| attempt(&bound, b"c", &values, [3, 0, 0, 0], &mut rng(20))).unwrap();
        assert_eq!(verify(&bound, b"c", &honest.proof, &mut rng(21)), Ok(()));
    }

    #[test]
    fn huge_values_are_refused_not_wrapped() {
        let bound = NormBound::new(4, 1 << 40).unwrap();
        for values in [[i64::MAX, 0, 0, 0], [i64::MIN, 1, 1, 1], [1 << 32, 1 << 32, 1 << 32, 1 << 32]] {
            assert!(matches!(prove(&bound, b"c", &values, &mut rng(22)), Err(ValidationError::Input(_))));
        }
    }

    /// Whether a field element's centred representative is at most `limit`.
    fn within(s: Scalar, limit: u128) -> bool {
        let small = |b: [u8; 32]| {
            b[16..].iter().all(|&x| x == 0) && u128::from_le_bytes(b[..16].try_into().unwrap()) <= limit
        };
        small(s.to_bytes()) || small((-s).to_bytes())
    }

    #[test]
    fn a_vector_that_wraps_around_the_group_order_cannot_show_small_projections() {
        // The attack the probes stop: entries that are huge field elements
        // (a square root modulo ℓ, say) can make Σ x² ≡ B² (mod ℓ) with an
        // integer norm far above B. Whatever its mask row, such a vector has
        // a projection out of range under almost every draw of the probes.
        let m = 2_000;
        let bound = NormBound::new(m, u128::from(m as u64 * 100 * 100)).unwrap();
        let t = bound.columns;
        let limit = bound.projection_limit();
        let (values, _) = input(m, 100, 90);
        let huge = [Scalar::from(1u128 << 100), -Scalar::from(7u128 << 90), random_scalar(&mut rng(91))];
        for (case, entry) in huge.into_iter().enumerate() {
            let mut cells: Vec<Scalar> = values.iter().map(|&v| scalar_i128(v.into())).collect();
            cells.resize(bound.padded_rows * t, Scalar::ZERO);
            cells[bound.squares_row() * t + 1] = entry;
            for seed in 0..20u8 {
                let probes = Probes::draw([seed; 32], bound.input_rows + 1, t);
                let caught = (0..PROBES).any(|l| {
                    let z: Scalar = probes
                        .alpha(l)
                        .iter()
                        .enumerate()
                        .filter(|(_, a)| **a != 0)
                        .map(|(i, &a)| {
                            let dot: Scalar = cells[i * t..(i + 1) * t]
                                .iter()
                                .zip(probes.beta(l))
                                .map(|(x, &b)| x * scalar_i128(b.into()))
                                .sum();
                            dot * scalar_i128(a.into())
                        })
                        .sum();
                    !within(z, limit)
                });
                assert!(caught, "case {case}, probes {seed}");
            }
        }
        // And the honest vector is never caught, by construction.
        let cells: Vec<i128> = values.iter().map(|&v| v.into()).collect();
        let probes = Probes::draw([1; 32], bound.input_rows + 1, t);
        for l in 0..PROBES {
            let z: i128 = probes
                .alpha(l)
                .iter()
                .enumerate()
                .map(|(i, &a)| {
                    let row = cells.get(i * t..((i + 1) * t).min(m)).unwrap_or(&[]);
                    i128::from(a)
                        * row.iter().zip(probes.beta(l)).map(|(x, &b)| x * i128::from(b)).sum::<i128>()
                })
                .sum();
            assert!(z.unsigned_abs() <= bound.honest_projection);
        }
    }

    #[test]
    fn accepted_projections_do_not_depend_on_the_input() {
        // Rejection sampling: the masked projections of a zero input and of
        // a large one come from the same range, centred, with the same
        // spread (a coarse check of the uniform law the proof relies on).
        let m = 64;
        let bound = NormBound::new(m, u128::from(m as u64 * 1000 * 1000)).unwrap();
        let limit = bound.projection_limit() as f64;
        for values in [vec![0i64; m], vec![1000i64; m]] {
            let z: Vec<f64> = (0..8u8)
                .flat_map(|seed| proven(&bound, b"c", &values, 80 + seed).proof.projections)
                .map(|z| z as f64 / limit)
                .collect();
            let mean = z.iter().sum::<f64>() / z.len() as f64;
            let var = z.iter().map(|v| v * v).sum::<f64>() / z.len() as f64;
            assert!(mean.abs() < 0.05, "mean {mean}");
            assert!((var - 1.0 / 3.0).abs() < 0.03, "variance {var} (uniform on [−1, 1]: 1/3)");
        }
    }
}
