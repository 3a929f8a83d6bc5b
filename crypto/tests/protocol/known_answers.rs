//! Known-answer tests for the primitives, against published vectors.

use cohort_crypto::Secret32;
use cohort_crypto::agreement::{AgreementKey, x25519};
use cohort_crypto::envelope::EnvelopeKey;
use cohort_crypto::kdf::hkdf_sha256;
use cohort_crypto::prg::{MaskPrg, MaskSign};
use cohort_crypto::signature::{IdentityKey, verify, verify_all};

fn bytes32(hex_str: &str) -> [u8; 32] {
    hex::decode(hex_str).unwrap().try_into().unwrap()
}

fn secret(hex_str: &str) -> Secret32 {
    Secret32::from_bytes(&mut bytes32(hex_str))
}

/// RFC 7748, section 5.2: both X25519 test vectors (the second with bit
/// 255 of u set), through an agreement key and through [`x25519`] itself.
#[test]
fn x25519_rfc7748_section_5_2() {
    for (scalar, u, out) in [
        (
            "a546e36bf0527c9d3b16154b82465edd62144c0ac1fc5a18506a2244ba449ac4",
            "e6db6867583030db3594c1a424b15f7c726624ec26b3353b10a903a6d0ab1c4c",
            "c3da55379de9c6908e94ea4df28d084f32eccf03491c71f754b4075577a28552",
        ),
        (
            "4b66e9d4d1b4673c5ad22691957d6af5c11b6421e0ea01d42ca4169e7918ba0d",
            "e5210f12786811d3f4b7959d0538ae2c31dbe7106fc03c3efc4cd549c715a493",
            "95cbde9476e8907d7aade45cb4b873f88b595a68799fa152e6f8f7647aac7957",
        ),
    ] {
        assert_eq!(x25519(&bytes32(scalar), &bytes32(u)), bytes32(out));
        assert!(AgreementKey::from_secret(&secret(scalar)).agree(&bytes32(u)).unwrap() == secret(out));
    }
}

/// RFC 7748, section 5.2: the iterated test, after 1 and 1 000 iterations.
#[test]
fn x25519_rfc7748_section_5_2_iterated() {
    let (mut k, mut u) = ([0u8; 32], [0u8; 32]);
    (k[0], u[0]) = (9, 9);
    for i in 1..=1000 {
        let next = x25519(&k, &u);
        (u, k) = (k, next);
        if i == 1 {
            assert_eq!(k, bytes32("422c8e7a6227d7bca1350b3e2bb7279f7897b87bb6854b783c60e80311ae3079"));
        }
    }
    assert_eq!(k, bytes32("684cf59ba83309552800ef566f2f4d3c1c3887c49360e3875f2eb94d99532c51"));
}

/// RFC 7748, section 6.1 (Diffie-Hellman between Alice and Bob).
#[test]
fn x25519_rfc7748_section_6_1() {
    let alice = AgreementKey::from_secret(&secret(
        "77076d0a7318a57d3c16c17251b26645df4c2f87ebc0992ab177fba51db92c2a",
    ));
    let bob = AgreementKey::from_secret(&secret(
        "5dab087e624a8a4b79e17f8b83800ee66f3bb1292618b6fd1c2f8b27ff88e0eb",
    ));
    assert_eq!(
        alice.public_key(),
        bytes32("8520f0098930a754748b7ddcb43ef75a0dbf3a0d26381af4eba4a98eaa9b4e6a")
    );
    assert_eq!(bob.public_key(), bytes32("de9edb7d7b7dc1b4d35b61c2ece435373f8343c85b78674dadfc7e146f882b4f"));
    let shared = secret("4a5d9d5ba4ce2de1728e3bf480350f25e07e21c947d19e3376f09b3c1e161742");
    assert!(alice.agree(&bob.public_key()).unwrap() == shared);
    assert!(bob.agree(&alice.public_key()).unwrap() == shared);
}

/// RFC 5869, appendix A.1 (test case 1, SHA-256).
#[test]
fn hkdf_rfc5869_case_1() {
    let ikm = [0x0b; 22];
    let salt = hex::decode("000102030405060708090a0b0c").unwrap();
    let info = hex::decode("f0f1f2f3f4f5f6f7f8f9").unwrap();
    let mut okm = [0u8; 42];
    hkdf_sha256(&salt, &ikm, &[&info], &mut okm);
    assert_eq!(
        hex::encode(okm),
        "3cb25f25faacd57a90434f64d0362f2a2d2d0a90cf1a5a4c5db02d56ecc4c5bf34007208d5b887185865"
    );
}

/// RFC 5869, appendix A.2 (test case 2: long inputs), with `info` passed in
/// two parts to check that the parts are concatenated.
#[test]
fn hkdf_rfc5869_case_2() {
    let ikm: Vec<u8> = (0x00..=0x4f).collect();
    let salt: Vec<u8> = (0x60..=0xaf).collect();
    let info: Vec<u8> = (0xb0..=0xff).collect();
    let mut okm = [0u8; 82];
    hkdf_sha256(&salt, &ikm, &[&info[..10], &info[10..]], &mut okm);
    assert_eq!(
        hex::encode(okm),
        "b11e398dc80327a1c8e7f78c596a49344f012eda2d4efad8a050cc4c19afa97c\
         59045a99cac7827271cb41c65e590e09da3275600c2f09b8367793a9aca3db71\
         cc30c58179ec3e87c14c01d5c1f3434f1d87"
    );
}

/// RFC 5869, appendix A.3 (test case 3: empty salt and info).
#[test]
fn hkdf_rfc5869_case_3() {
    let mut okm = [0u8; 42];
    hkdf_sha256(&[], &[0x0b; 22], &[], &mut okm);
    assert_eq!(
        hex::encode(okm),
        "8da4e775a563c18f715f802a063c5a31b8a11f5c5ee1879ec3454e5f3c738d2d9d201395faa4b61a96c8"
    );
}

/// NIST GCM specification (McGrew & Viega, "The Galois/Counter Mode of
/// Operation", appendix B), test cases 13 and 14: AES-256, zero key, the
/// all-zero 96-bit IV that share envelopes use.
#[test]
fn aes256_gcm_nist_test_cases_13_and_14() {
    let zero_key = || EnvelopeKey::new(Secret32::from_bytes(&mut [0u8; 32]));
    assert_eq!(hex::encode(zero_key().seal(&[], &[])), "530f8afbc74536b9a963b4f1c4cb738b");
    assert_eq!(
        hex::encode(zero_key().seal(&[], &[0u8; 16])),
        "cea7403d4d606b6e074ec5d3baf39d18d0d1c8a799996bf0265b98b5d48ab919"
    );
}

/// FIPS-197 / NIST AESAVS: AES-128 with the zero key maps the zero block to
/// 66e94bd4ef8a2c3b884cfa59ca342b2e. Counter 0 of the mask PRG is that block,
/// read as little-endian words.
#[test]
fn mask_prg_first_block_is_aes_of_counter_zero() {
    let mut words = [0u32; 4];
    MaskPrg::from_key(&[0u8; 16]).apply(&mut words, MaskSign::Add);
    let block: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
    assert_eq!(hex::encode(block), "66e94bd4ef8a2c3b884cfa59ca342b2e");
}

/// The mask PRG equals AES-128-CTR with a 128-bit big-endian counter from
/// zero, as computed by the independent `ctr` crate (over the portable `aes`
/// crate, so on 64-bit Linux and macOS this also compares the two backends),
/// across batch boundaries and from any starting block.
#[test]
fn mask_prg_matches_reference_ctr_mode() {
    use ctr::cipher::{KeyIvInit, StreamCipher};
    let key: [u8; 16] = *b"cohort-prg-key!!";
    for len in [1usize, 3, 4, 5, 255, 256, 257, 1000, 4099] {
        let mut stream = vec![0u8; len * 4];
        let mut reference = ctr::Ctr128BE::<aes::Aes128>::new(&key.into(), &[0u8; 16].into());
        reference.apply_keystream(&mut stream);
        let expected: Vec<u32> =
            stream.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
        let mut words = vec![0u32; len];
        MaskPrg::from_key(&key).apply(&mut words, MaskSign::Add);
        assert_eq!(words, expected, "len = {len}");
        MaskPrg::from_key(&key).apply(&mut words, MaskSign::Subtract);
        assert!(words.iter().all(|&w| w == 0));
    }
    // From any block on, as the unmasking's tiles take it.
    let mut stream = vec![0u8; 20_000 * 16];
    ctr::Ctr128BE::<aes::Aes128>::new(&key.into(), &[0u8; 16].into()).apply_keystream(&mut stream);
    let reference: Vec<u32> =
        stream.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
    for (first_block, len) in [(0u64, 7usize), (1, 4), (63, 260), (64, 1), (1000, 9000), (12_345, 4099)] {
        let start = first_block as usize * 4;
        let mut words = vec![5u32; len];
        MaskPrg::from_key(&key).apply_from(&mut words, first_block, MaskSign::Add);
        let expected: Vec<u32> = reference[start..start + len].iter().map(|w| w.wrapping_add(5)).collect();
        assert_eq!(words, expected, "from block {first_block}, {len} words");
        MaskPrg::from_key(&key).apply_from(&mut words, first_block, MaskSign::Subtract);
        assert!(words.iter().all(|&w| w == 5));
    }
    // Read in order in pieces of whole blocks (the last one need not be),
    // as a range of the unmasking is: the stream carries on where it was.
    for (first_block, pieces) in [(0u64, &[4usize, 8, 2048, 3][..]), (17, &[2052, 4, 4096, 1]), (3, &[9000])]
    {
        let prg = MaskPrg::from_key(&key);
        let mut stream = prg.stream_from(first_block);
        let mut buffer = cohort_crypto::prg::StreamBuffer::new();
        let mut at = first_block as usize * 4;
        for &len in pieces {
            let mut words = vec![9u32; len];
            stream.apply_next(&mut words, MaskSign::Subtract, &mut buffer);
            let expected: Vec<u32> = reference[at..at + len].iter().map(|w| 9u32.wrapping_sub(*w)).collect();
            assert_eq!(words, expected, "from block {first_block}, pieces {pieces:?}, at word {at}");
            at += len;
        }
    }
}

/// Several masks' key streams added to a vector together (as unmasking
/// adds up to `STREAMS_PER_PASS` of them in one pass over a tile) give what
/// the reference AES-128-CTR of each key gives, summed: for every number of
/// streams from none to more than two passes' worth, both signs, read in
/// pieces from a block other than the first, the last piece no whole block.
#[test]
fn mask_streams_applied_together_match_reference_ctr_mode() {
    use cohort_crypto::prg::{STREAMS_PER_PASS, StreamBuffer, apply_next_together};
    use ctr::cipher::{KeyIvInit, StreamCipher};
    let first_block = 17u64;
    let pieces = [2052usize, 4, 4096, 1];
    let total: usize = pieces.iter().sum();
    let keys: Vec<[u8; 16]> =
        (0..2 * STREAMS_PER_PASS as u8 + 3).map(|i| [i.wrapping_mul(29) ^ 0x5a; 16]).collect();
    let reference: Vec<Vec<u32>> = keys
        .iter()
        .map(|key| {
            let mut iv = [0u8; 16];
            iv[8..].copy_from_slice(&first_block.to_be_bytes());
            let mut stream = vec![0u8; total * 4];
            ctr::Ctr128BE::<aes::Aes128>::new(&(*key).into(), &iv.into()).apply_keystream(&mut stream);
            stream.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
        })
        .collect();
    for count in 0..=keys.len() {
        for sign in [MaskSign::Add, MaskSign::Subtract] {
            let prgs: Vec<MaskPrg> = keys[..count].iter().map(MaskPrg::from_key).collect();
            let mut streams: Vec<_> = prgs.iter().map(|prg| prg.stream_from(first_block)).collect();
            let mut buffer = StreamBuffer::new();
            let mut at = 0;
            for &len in &pieces {
                let mut words: Vec<u32> = (0..len as u32).map(|i| i.wrapping_mul(0x9e37_79b9)).collect();
                let expected: Vec<u32> = words
                    .iter()
                    .enumerate()
                    .map(|(i, &word)| {
                        reference[..count].iter().fold(word, |word, stream| match sign {
                            MaskSign::Add => word.wrapping_add(stream[at + i]),
                            MaskSign::Subtract => word.wrapping_sub(stream[at + i]),
                        })
                    })
                    .collect();
                apply_next_together(&mut streams, sign, &mut words, &mut buffer);
                assert_eq!(words, expected, "{count} streams, {sign:?}, {len} words at word {at}");
                at += len;
            }
        }
    }
}

/// RFC 8032, section 7.1, tests 1 (empty message) and 2: the keys and
/// signatures are the standard's, so identities made by earlier releases
/// still verify, singly and in a batch.
#[test]
fn ed25519_rfc8032_tests_1_and_2() {
    let mut checked = Vec::new();
    for (seed, public, message, signature) in [
        (
            "9d61b19deffd5a60ba844af492ec2cc44449c5697b326919703bac031cae7f60",
            "d75a980182b10ab7d54bfed3c964073a0ee172f3daa62325af021a68f707511a",
            "",
            "e5564300c360ac729086e2cc806e828a84877f1eb8e5d974d873e065224901555fb8821590a33bacc61e39701cf9b46bd25bf5f0595bbe24655141438e7a100b",
        ),
        (
            "4ccd089b28ff96da9db6c346ec114e0f5b8a319f35aba624da8cf6ed4fb8a6fb",
            "3d4017c3e843895a92b70aa74d1b7ebc9c982ccf2ec4968cc0cd55f12af4660c",
            "72",
            "92a009a9f0d4cab8720e820b5f642540a2b27b5416503f8fb3762223ebdb69da085ac1e43e15996e458f3613d0f11d8c387b2eaeb4302aeeb00d291612bb0c00",
        ),
    ] {
        let key = IdentityKey::from_seed(&secret(seed)).unwrap();
        let public = bytes32(public);
        assert_eq!(key.public_key(), public);
        let message = hex::decode(message).unwrap();
        assert_eq!(hex::encode(key.sign(&message)), signature);
        let signature: [u8; 64] = hex::decode(signature).unwrap().try_into().unwrap();
        assert!(verify(&public, &message, &signature).is_ok());
        checked.push((public, message, signature));
    }
    let batch: Vec<_> =
        checked.iter().map(|(public, message, signature)| (public, &message[..], signature)).collect();
    assert!(verify_all(&batch).is_ok());
}
