//! The mask PRG: AES-128 in counter mode.
//!
//! A 32-byte seed (a self-mask seed or an X25519 shared secret) is never used
//! as a cipher key directly: HKDF-SHA256 derives a 128-bit AES key from the
//! whole seed, salted with the round context and labelled with the purpose and
//! the identities involved. The key stream, read as little-endian 32-bit
//! words, is added to or subtracted from a vector modulo 2^32; reducing the
//! result modulo 2^b afterwards gives the same answer as working in Z_{2^b}
//! throughout, because 2^b divides 2^32.

use aes::Aes128;
use aes::cipher::{BlockCipherEncrypt, KeyInit};
use zeroize::Zeroizing;

use crate::kdf::hkdf_sha256;
use crate::secret::Secret32;

/// Blocks encrypted per batch: 1 KiB of key stream, enough for the AES-NI
/// backend to pipeline while staying in L1.
const BATCH_BLOCKS: usize = 64;
const WORDS_PER_BLOCK: usize = 4;

/// Whether a mask is added to or subtracted from a vector.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MaskSign {
    /// `v += PRG`.
    Add,
    /// `v -= PRG`.
    Subtract,
}

/// An AES-128-CTR key stream generator; its key schedule is zeroized on drop.
pub struct MaskPrg {
    cipher: Aes128,
}

impl MaskPrg {
    /// Derives the generator for `seed` with HKDF-SHA256(salt, seed, info).
    pub fn derive(seed: &Secret32, salt: &[u8], info: &[&[u8]]) -> Self {
        let mut key = Zeroizing::new([0u8; 16]);
        hkdf_sha256(salt, seed.expose(), info, key.as_mut());
        Self::from_key(&key)
    }

    /// Uses `key` directly as the AES-128 key (for known-answer tests).
    pub fn from_key(key: &[u8; 16]) -> Self {
        match Aes128::new_from_slice(key) {
            Ok(cipher) => Self { cipher },
            Err(_) => unreachable!("AES-128 keys are 16 bytes"),
        }
    }

    /// Adds (or subtracts) the key stream, starting at counter 0, to `target`
    /// word by word modulo 2^32.
    pub fn apply(&self, target: &mut [u32], sign: MaskSign) {
        match sign {
            MaskSign::Add => self.apply_signed::<true>(target),
            MaskSign::Subtract => self.apply_signed::<false>(target),
        }
    }

    fn apply_signed<const ADD: bool>(&self, target: &mut [u32]) {
        let mut blocks = [aes::Block::default(); BATCH_BLOCKS];
        let mut counter: u128 = 0;
        for chunk in target.chunks_mut(BATCH_BLOCKS * WORDS_PER_BLOCK) {
            let needed = chunk.len().div_ceil(WORDS_PER_BLOCK);
            for block in &mut blocks[..needed] {
                *block = counter.to_be_bytes().into();
                counter += 1;
            }
            self.cipher.encrypt_blocks(&mut blocks[..needed]);
            let (whole, tail) = chunk.split_at_mut(chunk.len() / WORDS_PER_BLOCK * WORDS_PER_BLOCK);
            for (block, words) in blocks.iter().zip(whole.chunks_exact_mut(WORDS_PER_BLOCK)) {
                let stream = block_words(block);
                for (word, s) in words.iter_mut().zip(stream) {
                    *word = if ADD { word.wrapping_add(s) } else { word.wrapping_sub(s) };
                }
            }
            if !tail.is_empty() {
                let stream = block_words(&blocks[whole.len() / WORDS_PER_BLOCK]);
                for (word, s) in tail.iter_mut().zip(stream) {
                    *word = if ADD { word.wrapping_add(s) } else { word.wrapping_sub(s) };
                }
            }
        }
        blocks.iter_mut().for_each(|block| block.fill(0));
    }
}

/// The four little-endian words of a key-stream block.
#[inline(always)]
fn block_words(block: &aes::Block) -> [u32; WORDS_PER_BLOCK] {
    let word = |i: usize| u32::from_le_bytes([block[i], block[i + 1], block[i + 2], block[i + 3]]);
    [word(0), word(4), word(8), word(12)]
}
