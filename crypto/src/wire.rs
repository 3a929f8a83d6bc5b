//! The binary encoding shared by every message.
//!
//! Each message starts with a 4-byte header: the magic `0xC0 0x5A`, the
//! format version and the message kind. Integers are little-endian; lists
//! carry a u32 count. Decoding is strict: every count is checked against the
//! bytes that remain before anything is allocated, every field is validated,
//! and trailing bytes are an error, so each value has exactly one encoding.

/// First two bytes of every message.
pub const MAGIC: [u8; 2] = [0xC0, 0x5A];

/// The encoding version this crate reads and writes.
pub const VERSION: u8 = 3;

/// Why a message could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeError {
    /// The input ended before the message did.
    #[error("message truncated")]
    Truncated,
    /// The message does not start with the magic bytes.
    #[error("not a Cohort secure-aggregation message")]
    BadMagic,
    /// The message uses an encoding version this build does not read.
    #[error("unsupported message version {0} (this build reads version {VERSION})")]
    UnsupportedVersion(u8),
    /// The message kind is unknown or not valid in this direction.
    #[error("unknown message kind {0}")]
    UnknownKind(u8),
    /// A count or length exceeds a limit or the remaining input.
    #[error("{0} is out of range")]
    OutOfRange(&'static str),
    /// A field holds an invalid value.
    #[error("invalid {0}")]
    Invalid(&'static str),
    /// Bytes remain after the message.
    #[error("{0} unexpected trailing bytes")]
    TrailingBytes(usize),
}

/// Appends encoded fields to a buffer.
pub(crate) struct Writer {
    buf: Vec<u8>,
}

impl Writer {
    pub(crate) fn with_header(kind: u8, capacity: usize) -> Self {
        let mut buf = Vec::with_capacity(capacity + 4);
        buf.extend_from_slice(&MAGIC);
        buf.push(VERSION);
        buf.push(kind);
        Self { buf }
    }

    pub(crate) fn raw() -> Self {
        Self { buf: Vec::new() }
    }

    pub(crate) fn u8(&mut self, value: u8) -> &mut Self {
        self.buf.push(value);
        self
    }

    pub(crate) fn u32(&mut self, value: u32) -> &mut Self {
        self.buf.extend_from_slice(&value.to_le_bytes());
        self
    }

    pub(crate) fn u64(&mut self, value: u64) -> &mut Self {
        self.buf.extend_from_slice(&value.to_le_bytes());
        self
    }

    pub(crate) fn bytes(&mut self, value: &[u8]) -> &mut Self {
        self.buf.extend_from_slice(value);
        self
    }

    /// A list length. Lists are bounded far below u32::MAX by construction.
    pub(crate) fn count(&mut self, len: usize) -> &mut Self {
        self.u32(len as u32)
    }

    pub(crate) fn buffer(&mut self) -> &mut Vec<u8> {
        &mut self.buf
    }

    pub(crate) fn finish(self) -> Vec<u8> {
        self.buf
    }
}

/// Reads fields from an input, refusing to read past its end.
pub(crate) struct Reader<'a> {
    input: &'a [u8],
}

impl<'a> Reader<'a> {
    /// Checks the header and returns the reader and the message kind.
    pub(crate) fn with_header(input: &'a [u8]) -> Result<(Self, u8), DecodeError> {
        let mut reader = Self { input };
        let magic = reader.array::<2>()?;
        if magic != MAGIC {
            return Err(DecodeError::BadMagic);
        }
        let version = reader.u8()?;
        if version != VERSION {
            return Err(DecodeError::UnsupportedVersion(version));
        }
        let kind = reader.u8()?;
        Ok((reader, kind))
    }

    pub(crate) fn take(&mut self, len: usize) -> Result<&'a [u8], DecodeError> {
        if self.input.len() < len {
            return Err(DecodeError::Truncated);
        }
        let (head, tail) = self.input.split_at(len);
        self.input = tail;
        Ok(head)
    }

    pub(crate) fn array<const N: usize>(&mut self) -> Result<[u8; N], DecodeError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }

    pub(crate) fn u8(&mut self) -> Result<u8, DecodeError> {
        Ok(self.array::<1>()?[0])
    }

    pub(crate) fn u32(&mut self) -> Result<u32, DecodeError> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    pub(crate) fn u64(&mut self) -> Result<u64, DecodeError> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    /// A list count of items at least `min_item_len` bytes each, at most
    /// `max`, and small enough to fit in the remaining input.
    pub(crate) fn count(
        &mut self,
        max: usize,
        min_item_len: usize,
        what: &'static str,
    ) -> Result<usize, DecodeError> {
        let count = self.u32()? as usize;
        if count > max {
            return Err(DecodeError::OutOfRange(what));
        }
        if count.saturating_mul(min_item_len) > self.input.len() {
            return Err(DecodeError::Truncated);
        }
        Ok(count)
    }

    pub(crate) fn finish(self) -> Result<(), DecodeError> {
        if self.input.is_empty() { Ok(()) } else { Err(DecodeError::TrailingBytes(self.input.len())) }
    }
}

/// Number of bytes `len` values of `bits` bits occupy when packed.
pub fn packed_len(len: usize, bits: u8) -> usize {
    (len * usize::from(bits)).div_ceil(8)
}

/// Packs values (each below 2^bits) into a little-endian bit stream.
pub(crate) fn pack(values: &[u32], bits: u8, out: &mut Vec<u8>) {
    if bits == 32 {
        out.reserve(values.len() * 4);
        for value in values {
            out.extend_from_slice(&value.to_le_bytes());
        }
        return;
    }
    out.reserve(packed_len(values.len(), bits));
    let mut acc: u64 = 0;
    let mut filled: u32 = 0;
    for &value in values {
        acc |= u64::from(value) << filled;
        filled += u32::from(bits);
        while filled >= 8 {
            out.push(acc as u8);
            acc >>= 8;
            filled -= 8;
        }
    }
    if filled > 0 {
        out.push(acc as u8);
    }
}

/// Unpacks `len` values of `bits` bits; padding bits must be zero.
pub(crate) fn unpack(bytes: &[u8], len: usize, bits: u8) -> Result<Vec<u32>, DecodeError> {
    if bytes.len() != packed_len(len, bits) {
        return Err(DecodeError::Truncated);
    }
    if !padding_is_zero(bytes, len, bits) {
        return Err(DecodeError::Invalid("padding bits"));
    }
    let mut values = vec![0u32; len];
    add_packed(bytes, bits, &mut values);
    Ok(values)
}

/// Whether the bits after the last of `len` values of `bits` bits in
/// `bytes` (the rest of the last byte) are zero, as the canonical encoding
/// requires. `bytes` holds exactly `packed_len(len, bits)` bytes.
pub(crate) fn padding_is_zero(bytes: &[u8], len: usize, bits: u8) -> bool {
    bytes.last().is_none_or(|last| last_byte_padding_is_zero(*last, len, bits))
}

/// Whether the padding bits in the last byte of `len` packed values of
/// `bits` bits are zero.
pub(crate) fn last_byte_padding_is_zero(last: u8, len: usize, bits: u8) -> bool {
    let used = (len * usize::from(bits)) % 8;
    used == 0 || last >> used == 0
}

/// Adds the `sum.len()` values of `bits` bits packed in `bytes` to `sum`,
/// word by word modulo 2^32, without decoding them into a vector first.
/// `bytes` holds exactly `packed_len(sum.len(), bits)` bytes (callers check
/// lengths and padding before anything is added); a piece that starts at a
/// multiple of 8 values starts at a byte boundary, so a long vector can be
/// added piece by piece.
pub(crate) fn add_packed(bytes: &[u8], bits: u8, sum: &mut [u32]) {
    combine_packed::<true>(bytes, bits, sum);
}

/// Subtracts what [`add_packed`] adds: takes a masked input that was added
/// in part back out of the running sum.
pub(crate) fn subtract_packed(bytes: &[u8], bits: u8, sum: &mut [u32]) {
    combine_packed::<false>(bytes, bits, sum);
}

fn combine_packed<const ADD: bool>(bytes: &[u8], bits: u8, sum: &mut [u32]) {
    debug_assert_eq!(bytes.len(), packed_len(sum.len(), bits));
    let combine = |total: &mut u32, value: u32| {
        *total = if ADD { total.wrapping_add(value) } else { total.wrapping_sub(value) };
    };
    if bits == 32 {
        for (total, word) in sum.iter_mut().zip(bytes.chunks_exact(4)) {
            combine(total, u32::from_le_bytes([word[0], word[1], word[2], word[3]]));
        }
        return;
    }
    let mask = (1u64 << bits) - 1;
    let mut acc: u64 = 0;
    let mut filled: u32 = 0;
    let mut input = bytes.iter();
    for total in sum.iter_mut() {
        while filled < u32::from(bits) {
            let Some(byte) = input.next() else { return };
            acc |= u64::from(*byte) << filled;
            filled += 8;
        }
        combine(total, (acc & mask) as u32);
        acc >>= bits;
        filled -= u32::from(bits);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packed_values_add_into_a_sum_as_they_decode_whole_or_in_pieces() {
        let mut rng = 0x9e37_79b9_7f4a_7c15u64;
        for bits in 2..=32u8 {
            let len = 1003;
            let values: Vec<u32> = (0..len)
                .map(|_| {
                    rng = rng.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                    ((rng >> 32) as u32) & (((1u64 << bits) - 1) as u32)
                })
                .collect();
            let mut packed = Vec::new();
            pack(&values, bits, &mut packed);
            assert!(padding_is_zero(&packed, len, bits));
            let start: Vec<u32> = (0..len as u32).map(|i| i.wrapping_mul(0x0101_0101)).collect();
            let expected: Vec<u32> = start.iter().zip(&values).map(|(a, b)| a.wrapping_add(*b)).collect();
            let mut whole = start.clone();
            add_packed(&packed, bits, &mut whole);
            assert_eq!(whole, expected, "bits = {bits}");
            // Pieces of 8 values start at byte boundaries.
            let mut pieces = start.clone();
            for (index, piece) in pieces.chunks_mut(16).enumerate() {
                let from = index * 16 * usize::from(bits) / 8;
                let to = from + packed_len(piece.len(), bits);
                add_packed(&packed[from..to], bits, piece);
            }
            assert_eq!(pieces, expected, "bits = {bits}, in pieces");
            // Subtracting takes the values back out, whole or in pieces.
            subtract_packed(&packed, bits, &mut whole);
            assert_eq!(whole, start, "bits = {bits}, subtracted");
            for (index, piece) in pieces.chunks_mut(24).enumerate() {
                let from = index * 24 * usize::from(bits) / 8;
                let to = from + packed_len(piece.len(), bits);
                subtract_packed(&packed[from..to], bits, piece);
            }
            assert_eq!(pieces, start, "bits = {bits}, subtracted in pieces");
            if (len * usize::from(bits)) % 8 != 0 {
                let mut dirty = packed.clone();
                *dirty.last_mut().unwrap() |= 0x80;
                assert!(!padding_is_zero(&dirty, len, bits), "bits = {bits}");
            }
        }
    }

    #[test]
    fn packing_round_trips_for_every_width() {
        for bits in 2..=32u8 {
            let max = if bits == 32 { u32::MAX } else { (1u32 << bits) - 1 };
            let values: Vec<u32> = (0..37u32).map(|i| i.wrapping_mul(2_654_435_761) & max).collect();
            let mut packed = Vec::new();
            pack(&values, bits, &mut packed);
            assert_eq!(packed.len(), packed_len(values.len(), bits));
            assert_eq!(unpack(&packed, values.len(), bits).unwrap(), values, "bits = {bits}");
        }
    }

    #[test]
    fn non_zero_padding_is_rejected() {
        let mut packed = Vec::new();
        pack(&[1, 2, 3], 5, &mut packed);
        *packed.last_mut().unwrap() |= 0x80;
        assert_eq!(unpack(&packed, 3, 5), Err(DecodeError::Invalid("padding bits")));
    }

    #[test]
    fn counts_cannot_exceed_the_input() {
        let bytes = [0xff, 0xff, 0xff, 0x0f, 1, 2];
        let mut reader = Reader { input: &bytes };
        assert_eq!(reader.count(usize::MAX, 1, "list"), Err(DecodeError::Truncated));
        let mut reader = Reader { input: &bytes };
        assert_eq!(reader.count(10, 1, "list"), Err(DecodeError::OutOfRange("list")));
    }
}
