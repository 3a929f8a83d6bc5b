//! Input validation under masking: a zero-knowledge proof that the vector a
//! client masked has L2 norm at most B, bound to what it masked.
//!
//! Secure aggregation hides every input, including one that would wreck the
//! model. Here each client commits to its (quantized, rotated) vector x ∈ Zᵐ
//! and proves ‖x‖₂ ≤ B without revealing anything else; the commitments are
//! linear, and their blinding factors are summed under the round's masks, so
//! once the sum is unmasked the coordinator checks that the sum of the
//! commitments opens to it ([`check_sum`]). A client that commits to one
//! vector and masks another is caught there; a client whose proof fails is
//! caught before its input is counted. The construction follows ACORN (Bell
//! et al., USENIX Security 2023): linear commitments whose randomness rides in
//! the secure aggregation, an exact norm bound, an approximate one against
//! wrap-around modulo the group order.
//!
//! ## The commitment
//! x (padded) is laid out as a matrix with t columns: u rows of the input,
//! one row holding four integers (a, b, c, d) with
//! ‖x‖² + a² + b² + c² + d² = B² (Lagrange's theorem; see `squares`), q rows
//! holding a mask y for the projections below, and zero rows up to a power of
//! two S. Each row i is committed as C_i = Σ_j X_ij·G_j + ρ_i·H over
//! Ristretto (Hyrax's matrix commitment), with t + 2 generators of unknown
//! relation. The row commitments of the input are what the coordinator adds up.
//!
//! ## The proof (Fiat–Shamir over a merlin transcript)
//! 1. **Projections** (against wrap-around). From the transcript (after every
//!    C_i): k = 309 probes, each a pair α_l ∈ {−1,0,1}^(u+1) (rows of the
//!    input and the squares), β_l ∈ {−1,0,1}^t, entries 0 with probability ½
//!    and ±1 with ¼ each. The prover reveals z'_l = α_lᵀXβ_l + y_l, where y_l
//!    is uniform in [−Y, Y], committed before the probes were known, and the
//!    prover starts over if some |z'_l| > Y − T' (rejection sampling: an
//!    accepted z' is uniform on [−(Y − T'), Y − T'] whatever x is, since an
//!    honest |α_lᵀXβ_l| ≤ T' = ⌈√(t(u+1))⌉·⌈B⌉). Y = 2⁴⁰·T', so a restart
//!    happens with probability about k·2⁻⁴⁰.
//! 2. **One sum.** With 128-bit batching weights γ_l and challenges μ, ν, the
//!    prover shows
//!    Σ_(i,j) X_ij·(σ_i·X_ij + μ·A_ij) = B² + μ·Σ_l γ_l·z'_l,
//!    where σ_i is 0 on the mask rows and 1 elsewhere, and
//!    A = Σ_l γ_l·α_l⊗β_l plus γ laid out on the mask rows plus ν^(j+1)
//!    on the padding cells of the last input row (see below). The σ part is
//!    ‖x‖² + a² + b² + c² + d², the A part is Σ_l γ_l·(α_lᵀXβ_l + y_l). A
//!    sum-check over the log₂(S·t) variables of the multilinear extensions
//!    reduces it to one point r; each round polynomial (degree 3) is sent as
//!    four Pedersen commitments, and the check g(0) + g(1) = previous claim
//!    is a commitment to zero whose blinding the prover reveals (Hyrax).
//! 3. **At the point.** The verifier computes σ̃(r) and Ã(r) itself (A is a
//!    sum of k tensors: O(k·(u + t)) work). The prover commits e = X̃(r) and
//!    proves (a) the last claim opens to e·(σ̃(r)·e + μ·Ã(r)), a Σ-protocol
//!    for a square, and (b) e = ⟨w, eq(r_col)⟩ for w = Σ_i eq(r_row, i)·X_i,
//!    whose commitment Σ_i eq(r_row, i)·C_i the verifier forms from the rows:
//!    a masked dot-product proof (w* = c·w + d for a random d) compressed by a
//!    Bulletproofs inner-product argument over t.
//!
//! ## Soundness
//! * *Projections.* Fix X and y (committed before the probes). For a field
//!   element v write |v| for the magnitude of its centred representative.
//!   Lemma: if for some (i, j) both |2X_ij| and |4X_ij| exceed 8Y, a probe
//!   yields |z'_l| ≤ Y with probability at most ¾. Proof: condition on every
//!   entry of β but β_j; (Xβ)_i takes the values c, c ± X_ij. If two of them
//!   were "short" (|s| ≤ 2Y or |2s| ≤ 2Y, so |2s| ≤ 4Y), twice their
//!   difference (2X_ij or 4X_ij) would have magnitude ≤ 8Y; so with
//!   probability ≥ ½, (Xβ)_i is not short. Then condition on every entry of α
//!   but α_i: z'_l takes the values c', c' ± (Xβ)_i; two of them within
//!   [−Y, Y] would make (Xβ)_i or 2(Xβ)_i at most 2Y, i.e. short; so
//!   |z'_l| ≤ Y with probability ≤ ½. Together ≤ ½ + ½·½ = ¾. With k = 309
//!   probes a vector with such an entry passes with probability
//!   (¾)³⁰⁹ < 2⁻¹²⁸. Otherwise every 4X_ij is congruent to an integer of
//!   magnitude ≤ 16Y.
//! * *No wrap-around.* [`NormBound::new`] refuses parameters unless
//!   S·t·(16Y)² < ℓ. Then Σ (4X_ij)² over the σ rows is an integer below ℓ,
//!   so the sum-checked identity Σ X_ij² ≡ B² (mod ℓ), times 16, holds over
//!   the integers: the input rows, read as the rational vector (4X)/4, have
//!   Euclidean norm at most B. A committed vector need not be an integer
//!   vector (two colluders may each commit ½ where their sum has 1), but the
//!   coordinator only ever uses a sum, which [`check_sum`] ties to the
//!   integer sum the masks hid: any set of clients' committed vectors sums
//!   to a vector of norm at most their number times B.
//! * *Zero padding.* The cells of the last input row past the input are
//!   proven zero (a ν-weighted linear form in the sum-check's claim), so a
//!   commitment cannot carry anything the unmasked sum does not.
//! * *Sum-check and openings.* The batching (γ, 128 bits) fails with
//!   probability ≤ 2⁻¹²⁸, μ with ≤ 2/ℓ and ν with ≤ t/ℓ; the sum-check with
//!   ≤ 3·log₂(S·t)/ℓ; the Σ-protocol and the dot-product proof are special
//!   sound, and the inner-product argument is sound under the discrete
//!   logarithm assumption in Ristretto, as is the binding of every
//!   commitment (Bulletproofs, Bünz et al. S&P 2018; Hyrax, Wahby et al.
//!   S&P 2018).
//! * *Bound to the input and the round.* The transcript starts with the
//!   caller's context (the round context and the client's id): a proof for
//!   another round, client or vector does not verify. The binding to the
//!   masked input is [`check_sum`]: the unmasked sum must open the sum of the
//!   input-row commitments under the unmasked sum of their blindings.
//!
//! ## Zero knowledge
//! The commitments are perfectly hiding; z' is uniform whatever x is; every
//! revealed blinding is masked by a fresh uniform one; w* = c·w + d is
//! uniform, so the inner-product argument on it reveals nothing about w. The
//! coordinator learns B, the commitments, and, after unmasking, the sum.
//!
//! ## Under differential privacy
//! A private round's client proves its rounded vector before the noise,
//! within the sensitivity Δ₂ (values read as signed integers of the ring),
//! and draws its noise on edges that three of its neighbours verify, so
//! that the noise cannot carry a larger update: see [`noise`].
//!
//! ## What it does not do
//! It does not say who cheated when [`check_sum`] fails: a client that
//! masks another vector than it proved makes the sum check of its group
//! fail, and every contributor is a suspect; the coordinator must find it
//! across rounds (or the round is lost).
//!
//! It bounds the norm, not the direction: a client may still send any vector
//! of norm ≤ B (a targeted or backdoor update within the bound), and a
//! group's sum is only as good as the bound times the number of clients
//! that cheat. The prover is not constant-time in the input (bucketed
//! multiscalar multiplication): a co-located observer of the client's
//! caches is outside the threat model, the coordinator is not.

mod group;
pub mod noise;
mod proof;
mod round;
mod squares;

use std::sync::Arc;

pub use proof::{Commitment, NormProof, Proven, check_sum, prove, verify, verify_batch, verify_each};
pub use round::RoundValidation;

use group::Generators;

/// Probes against wrap-around: (¾)^309 < 2^-128.
pub const PROBES: usize = 309;
/// Statistical room of the projection masks: Y = 2^40·T'.
const MASK_BITS: u32 = 40;
/// Largest input dimension accepted.
pub const MAX_DIMENSION: usize = 1 << 24;

/// Why a proof could not be made or was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ValidationError {
    /// The parameters cannot be proven soundly (see [`NormBound::new`]).
    #[error("unsupported validation parameters: {0}")]
    Parameters(&'static str),
    /// The prover's own input has the wrong length or exceeds the bound.
    #[error("the input cannot be proven: {0}")]
    Input(&'static str),
    /// A proof or commitment that does not decode.
    #[error("malformed proof: {0}")]
    Malformed(&'static str),
    /// A well-formed proof that does not verify; names the check.
    #[error("proof rejected: {0}")]
    Rejected(&'static str),
}

/// The statement "‖x‖₂² ≤ B² for x ∈ Z^dimension" with the layout and the
/// generators its proofs use. The t + 2 generators (about 10 µs each) are
/// derived once per process and size.
#[derive(Clone)]
pub struct NormBound {
    dimension: usize,
    bound_sq: u128,
    columns: usize,
    input_rows: usize,
    mask_rows: usize,
    padded_rows: usize,
    honest_projection: u128,
    mask_bound: u128,
    generators: Arc<Generators>,
}

impl std::fmt::Debug for NormBound {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NormBound")
            .field("dimension", &self.dimension)
            .field("bound_sq", &self.bound_sq)
            .field("columns", &self.columns)
            .field("rows", &self.padded_rows)
            .finish_non_exhaustive()
    }
}

impl NormBound {
    /// The statement for vectors of `dimension` integers with squared norm at
    /// most `bound_sq`. The number of columns is the power of two nearest
    /// √(8·dimension) (between 8 and 4096): proofs then carry about √(m/8)
    /// row commitments and an inner-product argument over t.
    pub fn new(dimension: usize, bound_sq: u128) -> Result<Self, ValidationError> {
        if dimension == 0 || dimension > MAX_DIMENSION {
            return Err(ValidationError::Parameters("the dimension must be between 1 and 2^24"));
        }
        if bound_sq == 0 || bound_sq >= 1 << 100 {
            return Err(ValidationError::Parameters("the squared bound must be between 1 and 2^100"));
        }
        let columns = ((8.0 * dimension as f64).sqrt().ceil() as usize).next_power_of_two().clamp(8, 4096);
        Self::with_columns(dimension, bound_sq, columns)
    }

    fn with_columns(dimension: usize, bound_sq: u128, columns: usize) -> Result<Self, ValidationError> {
        let input_rows = dimension.div_ceil(columns);
        let mask_rows = PROBES.div_ceil(columns);
        let padded_rows = (input_rows + 1 + mask_rows).next_power_of_two();
        let bound = bound_sq.isqrt() + 1;
        let spread = (((input_rows + 1) * columns) as u128).isqrt() + 1;
        let honest_projection = spread * bound;
        let mask_bound = honest_projection << MASK_BITS;
        // S·t·(16Y)² < ℓ, ℓ > 2^252: bits(S·t) + 2·(bits(Y) + 4) ≤ 252.
        let cells_bits = (padded_rows * columns).trailing_zeros() + 1;
        let mask_bits = 128 - mask_bound.leading_zeros();
        if cells_bits + 2 * (mask_bits + 4) > 252 {
            return Err(ValidationError::Parameters("the bound is too large for the group order"));
        }
        Ok(Self {
            dimension,
            bound_sq,
            columns,
            input_rows,
            mask_rows,
            padded_rows,
            honest_projection,
            mask_bound,
            generators: Generators::cached(columns),
        })
    }

    /// The input dimension m.
    pub fn dimension(&self) -> usize {
        self.dimension
    }

    /// B².
    pub fn bound_sq(&self) -> u128 {
        self.bound_sq
    }

    /// Row commitments of the input that [`check_sum`] adds up (and whose
    /// blindings a client masks): ⌈m / t⌉.
    pub fn input_rows(&self) -> usize {
        self.input_rows
    }

    /// The encoded size of a proof, row commitments included.
    pub fn proof_len(&self) -> usize {
        proof::encoded_len(self)
    }

    fn rounds(&self) -> usize {
        (self.padded_rows * self.columns).trailing_zeros() as usize
    }

    fn column_bits(&self) -> usize {
        self.columns.trailing_zeros() as usize
    }

    fn committed_rows(&self) -> usize {
        self.input_rows + 1 + self.mask_rows
    }

    fn squares_row(&self) -> usize {
        self.input_rows
    }

    fn first_mask_row(&self) -> usize {
        self.input_rows + 1
    }

    /// Largest |z'_l| an honest proof shows.
    fn projection_limit(&self) -> u128 {
        self.mask_bound - self.honest_projection
    }
}
