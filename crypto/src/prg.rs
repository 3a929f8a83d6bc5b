//! The mask PRG: AES-128 in counter mode.
//!
//! A 32-byte seed (a self-mask seed or an X25519 shared secret) is never used
//! as a cipher key directly: HKDF-SHA256 derives a 128-bit AES key from the
//! whole seed, salted with the round context and labelled with the purpose and
//! the identities involved. The key stream, read as little-endian 32-bit
//! words, is added to or subtracted from a vector modulo 2^32; reducing the
//! result modulo 2^b afterwards gives the same answer as working in Z_{2^b}
//! throughout, because 2^b divides 2^32.
//!
//! Two implementations give the same key stream: on 64-bit Linux and macOS
//! servers and clients, AWS-LC's AES-CTR (`aws-lc-rs`, the assembly OpenSSL
//! also uses, about 1.3x the portable one here); everywhere else (wasm32,
//! Android), the portable `aes` crate, which still uses AES-NI or the ARMv8
//! instructions where the target has them. The known-answer tests hold for
//! both, and `the_backends_give_the_same_key_stream` compares them.

use zeroize::Zeroizing;

use crate::kdf::hkdf_sha256;
use crate::secret::Secret32;

/// Key-stream words per AES block.
pub const WORDS_PER_BLOCK: usize = 4;

/// Whether a mask is added to or subtracted from a vector.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MaskSign {
    /// `v += PRG`.
    Add,
    /// `v -= PRG`.
    Subtract,
}

impl MaskSign {
    /// The other sign: what removes a mask applied with this one.
    pub fn inverse(self) -> Self {
        match self {
            MaskSign::Add => MaskSign::Subtract,
            MaskSign::Subtract => MaskSign::Add,
        }
    }
}

/// An AES-128-CTR key stream generator; its key schedule is zeroized on drop.
pub struct MaskPrg {
    cipher: backend::Cipher,
}

impl MaskPrg {
    /// Derives the generator for `seed` with HKDF-SHA256(salt, seed, info).
    pub fn derive(seed: &Secret32, salt: &[u8], info: &[&[u8]]) -> Self {
        Self::from_key(&Self::derive_key(seed, salt, info))
    }

    /// The AES-128 key [`derive`](Self::derive) uses: what a host that
    /// computes the key stream itself (the browser, through WebCrypto's
    /// AES-CTR with a 128-bit big-endian counter from zero) is given.
    pub fn derive_key(seed: &Secret32, salt: &[u8], info: &[&[u8]]) -> Zeroizing<[u8; 16]> {
        let mut key = Zeroizing::new([0u8; 16]);
        hkdf_sha256(salt, seed.expose(), info, key.as_mut());
        key
    }

    /// Uses `key` directly as the AES-128 key (for known-answer tests).
    pub fn from_key(key: &[u8; 16]) -> Self {
        Self { cipher: backend::Cipher::new(key) }
    }

    /// Adds (or subtracts) the key stream, starting at counter 0, to `target`
    /// word by word modulo 2^32.
    pub fn apply(&self, target: &mut [u32], sign: MaskSign) {
        self.apply_from(target, 0, sign);
    }

    /// Adds (or subtracts) the key stream from block `first_block` on to
    /// `target`: word `i` of `target` takes key-stream word
    /// `4 · first_block + i`. A vector cut into pieces whose lengths are
    /// multiples of [`WORDS_PER_BLOCK`] is masked piece by piece exactly as
    /// it is whole, so a long vector can be unmasked one cache-sized tile
    /// at a time.
    pub fn apply_from(&self, target: &mut [u32], first_block: u64, sign: MaskSign) {
        let mut buffer = StreamBuffer::new();
        self.stream_from(first_block).apply_next(target, sign, &mut buffer);
    }

    /// The key stream from block `first_block` on, to be read in order by
    /// [`KeyStream::apply_next`]: what unmasking uses to walk many masks
    /// over one range of a vector a tile at a time, each mask's cipher set
    /// up once for the whole range.
    pub fn stream_from(&self, first_block: u64) -> KeyStream<'_> {
        KeyStream { inner: self.cipher.stream(u128::from(first_block)) }
    }
}

/// A mask's key stream being read in order (see [`MaskPrg::stream_from`]);
/// the cipher's state is zeroized on drop.
pub struct KeyStream<'a> {
    inner: backend::Stream<'a>,
}

impl KeyStream<'_> {
    /// Adds (or subtracts) the next `target.len()` words of the key stream
    /// to `target`, word by word modulo 2^32, using `buffer` for the key
    /// stream on its way. Every call but a stream's last must take a
    /// multiple of [`WORDS_PER_BLOCK`] words: the key stream is made a
    /// whole block at a time, and the rest of a block is not kept.
    pub fn apply_next(&mut self, target: &mut [u32], sign: MaskSign, buffer: &mut StreamBuffer) {
        match sign {
            MaskSign::Add => self.inner.add::<true>(target, &mut buffer.0),
            MaskSign::Subtract => self.inner.add::<false>(target, &mut buffer.0),
        }
    }
}

/// Key streams read together by [`apply_next_together`]: on the AWS-LC
/// backend, up to this many masks are added to a tile in one pass over it.
pub const STREAMS_PER_PASS: usize = backend::STREAMS_PER_PASS;

/// Adds (or subtracts, every one with `sign`) the next `target.len()` words
/// of each of `streams` to `target`, word by word modulo 2^32: what calling
/// [`KeyStream::apply_next`] for each stream in turn does, with the same
/// rule on lengths. The AWS-LC backend writes up to [`STREAMS_PER_PASS`]
/// streams' key stream into `buffer` and then adds their sum to the target
/// in one pass, so the target is read and written once per that many masks
/// rather than once per mask.
pub fn apply_next_together(
    streams: &mut [KeyStream<'_>],
    sign: MaskSign,
    target: &mut [u32],
    buffer: &mut StreamBuffer,
) {
    match sign {
        MaskSign::Add => backend::add_together::<true>(streams, target, &mut buffer.0),
        MaskSign::Subtract => backend::add_together::<false>(streams, target, &mut buffer.0),
    }
}

/// Room for key stream on its way into a vector (on the AWS-LC backend
/// 8 KiB for each of [`STREAMS_PER_PASS`] streams): one per thread, reused
/// across masks (filling it is the cipher's work, not a fresh allocation's),
/// zeroized on drop.
pub struct StreamBuffer(backend::Buffer);

impl StreamBuffer {
    /// An empty buffer.
    pub fn new() -> Self {
        Self(backend::Buffer::new())
    }
}

impl Default for StreamBuffer {
    fn default() -> Self {
        Self::new()
    }
}

/// `word ± s` modulo 2^32.
#[inline(always)]
fn combine<const ADD: bool>(word: u32, s: u32) -> u32 {
    if ADD { word.wrapping_add(s) } else { word.wrapping_sub(s) }
}

/// AWS-LC's AES-128-CTR.
#[cfg(all(
    any(target_arch = "x86_64", target_arch = "aarch64"),
    any(target_os = "linux", target_os = "macos")
))]
mod backend {
    use aws_lc_rs::cipher::{AES_128, EncryptionContext, StreamingEncryptingKey, UnboundCipherKey};
    use aws_lc_rs::iv::FixedLength;
    use zeroize::{Zeroize, Zeroizing};

    use super::{KeyStream, WORDS_PER_BLOCK, combine};

    /// Words of key stream per call: 8 KiB, enough to amortise a call and
    /// small enough to stay in L1 beside the words it is added to.
    const BATCH_WORDS: usize = 2048;

    /// Key streams added to a target in one pass.
    pub(super) const STREAMS_PER_PASS: usize = 4;

    /// What the cipher encrypts: CTR mode XORs the key stream into its
    /// input, so zeros give the key stream itself. Reading them costs what
    /// encrypting a buffer in place costs, and nothing has to clear the
    /// buffer between calls.
    static ZEROS: [u8; BATCH_WORDS * 4] = [0; BATCH_WORDS * 4];

    /// The AES key; each stream sets up its own schedule from it (AWS-LC
    /// cleanses a context's schedule when it is freed).
    pub(super) struct Cipher(Zeroizing<[u8; 16]>);

    /// An AWS-LC cipher context in CTR mode, positioned at some block.
    pub(super) struct Stream<'a> {
        key: StreamingEncryptingKey,
        _cipher: core::marker::PhantomData<&'a Cipher>,
    }

    /// 8 KiB of key stream for each of [`STREAMS_PER_PASS`] streams.
    pub(super) struct Buffer(Box<[[u32; BATCH_WORDS]; STREAMS_PER_PASS]>);

    impl Buffer {
        pub(super) fn new() -> Self {
            Self(Box::new([[0; BATCH_WORDS]; STREAMS_PER_PASS]))
        }
    }

    impl Drop for Buffer {
        fn drop(&mut self) {
            self.0.zeroize();
        }
    }

    impl Cipher {
        pub(super) fn new(key: &[u8; 16]) -> Self {
            Self(Zeroizing::new(*key))
        }

        pub(super) fn stream(&self, counter: u128) -> Stream<'_> {
            let iv = EncryptionContext::Iv128(FixedLength::from(counter.to_be_bytes()));
            match UnboundCipherKey::new(&AES_128, self.0.as_ref())
                .and_then(|key| StreamingEncryptingKey::less_safe_ctr(key, iv))
            {
                Ok(key) => Stream { key, _cipher: core::marker::PhantomData },
                Err(_) => unreachable!("AES-128 takes 16-byte keys and 16-byte counters in CTR mode"),
            }
        }
    }

    impl Stream<'_> {
        /// Adds (or subtracts) the next key-stream words to `target`:
        /// AWS-LC writes up to 8 KiB of it into `buffer` at a time, which
        /// is then combined with the target's words.
        pub(super) fn add<const ADD: bool>(&mut self, target: &mut [u32], buffer: &mut Buffer) {
            let [stream, ..] = &mut *buffer.0;
            for chunk in target.chunks_mut(BATCH_WORDS) {
                let stream = self.fill(stream, chunk.len());
                for (word, s) in chunk.iter_mut().zip(stream.iter()) {
                    *word = combine::<ADD>(*word, u32::from_le(*s));
                }
            }
        }

        /// The next `len` words of key stream (`len` at most
        /// [`BATCH_WORDS`]), written into `buffer` a whole block at a time.
        fn fill<'b>(&mut self, buffer: &'b mut [u32; BATCH_WORDS], len: usize) -> &'b [u32] {
            let words = len.next_multiple_of(WORDS_PER_BLOCK);
            let stream = &mut buffer[..words];
            match self.key.less_safe_update(&ZEROS[..words * 4], bytemuck::cast_slice_mut(stream)) {
                Ok(update) if update.written().len() == words * 4 => {}
                _ => unreachable!("CTR mode writes as many bytes as it reads, a whole number of blocks"),
            }
            &buffer[..len]
        }
    }

    /// Adds (or subtracts) the next key-stream words of every stream to
    /// `target`, [`BATCH_WORDS`] words at a time: for each batch, up to
    /// [`STREAMS_PER_PASS`] streams are written into `buffer` and their sum
    /// is added to the target's words in one pass.
    pub(super) fn add_together<const ADD: bool>(
        streams: &mut [KeyStream<'_>],
        target: &mut [u32],
        buffer: &mut Buffer,
    ) {
        let [b0, b1, b2, b3] = &mut *buffer.0;
        for chunk in target.chunks_mut(BATCH_WORDS) {
            let len = chunk.len();
            for group in streams.chunks_mut(STREAMS_PER_PASS) {
                match group {
                    [a, b, c, d] => {
                        let streams = [
                            a.inner.fill(b0, len),
                            b.inner.fill(b1, len),
                            c.inner.fill(b2, len),
                            d.inner.fill(b3, len),
                        ];
                        add_sum::<ADD, 4>(chunk, streams);
                    }
                    [a, b, c] => {
                        let streams = [a.inner.fill(b0, len), b.inner.fill(b1, len), c.inner.fill(b2, len)];
                        add_sum::<ADD, 3>(chunk, streams);
                    }
                    [a, b] => add_sum::<ADD, 2>(chunk, [a.inner.fill(b0, len), b.inner.fill(b1, len)]),
                    [a] => add_sum::<ADD, 1>(chunk, [a.inner.fill(b0, len)]),
                    _ => unreachable!("chunks of streams are never empty nor longer than four"),
                }
            }
        }
    }

    /// `target[i] ± Σ streams[k][i]` modulo 2^32 for every word: the
    /// target loaded and stored once for `N` streams.
    #[inline(always)]
    fn add_sum<const ADD: bool, const N: usize>(target: &mut [u32], streams: [&[u32]; N]) {
        let len = target.len();
        let streams = streams.map(|stream| &stream[..len]);
        for (i, word) in target.iter_mut().enumerate() {
            let total =
                streams.iter().fold(0u32, |total, stream| total.wrapping_add(u32::from_le(stream[i])));
            *word = combine::<ADD>(*word, total);
        }
    }
}

/// The portable `aes` crate (AES-NI, ARMv8 or constant-time software).
#[cfg(not(all(
    any(target_arch = "x86_64", target_arch = "aarch64"),
    any(target_os = "linux", target_os = "macos")
)))]
mod backend {
    use aes::Aes128;
    use aes::cipher::{BlockCipherEncrypt, KeyInit};
    use zeroize::Zeroize;

    use super::{KeyStream, WORDS_PER_BLOCK, combine};

    /// Blocks encrypted per batch: 1 KiB of key stream, enough for AES-NI
    /// to pipeline while staying in L1.
    const BATCH_BLOCKS: usize = 64;

    /// Streams are added one at a time: each block is combined with the
    /// target as soon as it is encrypted.
    pub(super) const STREAMS_PER_PASS: usize = 1;

    /// Adds (or subtracts) the next key-stream words of every stream to
    /// `target`, one stream after another.
    pub(super) fn add_together<const ADD: bool>(
        streams: &mut [KeyStream<'_>],
        target: &mut [u32],
        buffer: &mut Buffer,
    ) {
        for stream in streams {
            stream.inner.add::<ADD>(target, buffer);
        }
    }

    /// The expanded key (zeroized on drop by the `aes` crate).
    pub(super) struct Cipher(Aes128);

    /// The key and the next block's counter.
    pub(super) struct Stream<'a> {
        cipher: &'a Aes128,
        counter: u128,
    }

    /// 1 KiB of key stream.
    pub(super) struct Buffer([aes::Block; BATCH_BLOCKS]);

    impl Buffer {
        pub(super) fn new() -> Self {
            Self([aes::Block::default(); BATCH_BLOCKS])
        }
    }

    impl Drop for Buffer {
        fn drop(&mut self) {
            self.0.iter_mut().for_each(|block| block.as_mut_slice().zeroize());
        }
    }

    impl Cipher {
        pub(super) fn new(key: &[u8; 16]) -> Self {
            match Aes128::new_from_slice(key) {
                Ok(cipher) => Self(cipher),
                Err(_) => unreachable!("AES-128 keys are 16 bytes"),
            }
        }

        pub(super) fn stream(&self, counter: u128) -> Stream<'_> {
            Stream { cipher: &self.0, counter }
        }
    }

    impl Stream<'_> {
        /// Adds (or subtracts) the next key-stream words to `target`, 64
        /// blocks at a time, each block's words combined with the target's
        /// as soon as it is encrypted.
        pub(super) fn add<const ADD: bool>(&mut self, target: &mut [u32], buffer: &mut Buffer) {
            let blocks = &mut buffer.0;
            for chunk in target.chunks_mut(BATCH_BLOCKS * WORDS_PER_BLOCK) {
                let needed = chunk.len().div_ceil(WORDS_PER_BLOCK);
                for block in &mut blocks[..needed] {
                    *block = self.counter.to_be_bytes().into();
                    self.counter += 1;
                }
                self.cipher.encrypt_blocks(&mut blocks[..needed]);
                for (block, words) in blocks.iter().zip(chunk.chunks_mut(WORDS_PER_BLOCK)) {
                    for (word, bytes) in words.iter_mut().zip(block.chunks_exact(4)) {
                        let s = u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]);
                        *word = combine::<ADD>(*word, s);
                    }
                }
            }
        }
    }
}
