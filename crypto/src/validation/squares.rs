//! Lagrange's four-square decomposition of a 64-bit integer.
//!
//! The norm proof shows ‖x‖² ≤ B² by showing ‖x‖² + a² + b² + c² + d² = B²
//! exactly, with (a, b, c, d) a decomposition of B² − ‖x‖² (every
//! non-negative integer has one). The search takes a and b greedily so that
//! the rest p = N − a² − b² is small, and writes p as c² + d² when p is 0, 1,
//! 2, a square, a prime ≡ 1 (mod 4) (Hermite–Serret: a square root of −1
//! modulo p, then Euclid's algorithm), or small enough to search.

/// Below this, a rest p is written as a sum of two squares by search.
const SEARCH_BELOW: u64 = 1 << 16;

/// (a, b, c, d) with a² + b² + c² + d² = n, for n < 2^126.
pub(crate) fn four_squares(n: u128) -> [u128; 4] {
    if n == 0 {
        return [0; 4];
    }
    // n = 4^e · m: decompose m and scale by 2^e.
    let e = n.trailing_zeros() / 2;
    let m = n >> (2 * e);
    let mut a = m.isqrt();
    loop {
        let rest_a = m - a * a;
        let mut b = rest_a.isqrt();
        // For a large rest, the first few hundred b already give a prime
        // p ≡ 1 (mod 4) with overwhelming probability; smaller ones are
        // searched in full. A rest of 64 bits or more (a far below √m,
        // never reached in practice) is skipped.
        let mut tried = 0;
        loop {
            let p = rest_a - b * b;
            if let Some([c, d]) = u64::try_from(p).ok().and_then(two_squares) {
                return [a << e, b << e, u128::from(c) << e, u128::from(d) << e];
            }
            tried += 1;
            if b == 0 || (tried > 4096 && rest_a >= u128::from(SEARCH_BELOW)) {
                break;
            }
            b -= 1;
        }
        assert!(a > 0, "every integer is a sum of four squares");
        a -= 1;
    }
}

/// (c, d) with c² + d² = p, when this module can find one.
fn two_squares(p: u64) -> Option<[u64; 2]> {
    let root = p.isqrt();
    if root * root == p {
        return Some([root, 0]);
    }
    if p < SEARCH_BELOW {
        return (1..=(p / 2).isqrt()).find_map(|c| {
            let d = (p - c * c).isqrt();
            (c * c + d * d == p).then_some([d, c])
        });
    }
    if p % 4 != 1 || !is_prime(p) {
        return None;
    }
    let i = sqrt_minus_one(p);
    // Hermite–Serret: run Euclid on (p, i) until the remainder drops below √p.
    let (mut r0, mut r1) = (p, i);
    while r1 > root {
        (r0, r1) = (r1, r0 % r1);
    }
    let c = r1;
    let d = (p - c * c).isqrt();
    (c * c + d * d == p).then_some([c, d])
}

/// A square root of −1 modulo a prime p ≡ 1 (mod 4).
fn sqrt_minus_one(p: u64) -> u64 {
    // q^((p−1)/4) for a quadratic non-residue q squares to −1.
    let mut q = 2;
    while pow_mod(q, (p - 1) / 2, p) != p - 1 {
        q += 1;
    }
    pow_mod(q, (p - 1) / 4, p)
}

/// Deterministic Miller–Rabin for 64-bit integers (bases from Jaeschke and
/// Sinclair, exact below 2^64).
pub(crate) fn is_prime(n: u64) -> bool {
    if n < 2 {
        return false;
    }
    for small in [2u64, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37] {
        if n % small == 0 {
            return n == small;
        }
    }
    let s = (n - 1).trailing_zeros();
    let d = (n - 1) >> s;
    'bases: for base in [2u64, 325, 9375, 28178, 450775, 9780504, 1795265022] {
        let a = base % n;
        if a == 0 {
            continue;
        }
        let mut x = pow_mod(a, d, n);
        if x == 1 || x == n - 1 {
            continue;
        }
        for _ in 1..s {
            x = mul_mod(x, x, n);
            if x == n - 1 {
                continue 'bases;
            }
        }
        return false;
    }
    true
}

fn mul_mod(a: u64, b: u64, m: u64) -> u64 {
    ((u128::from(a) * u128::from(b)) % u128::from(m)) as u64
}

fn pow_mod(mut base: u64, mut exponent: u64, m: u64) -> u64 {
    let mut result = 1 % m;
    base %= m;
    while exponent > 0 {
        if exponent & 1 == 1 {
            result = mul_mod(result, base, m);
        }
        base = mul_mod(base, base, m);
        exponent >>= 1;
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(n: u128) {
        let [a, b, c, d] = four_squares(n);
        let sum = [a, b, c, d].iter().map(|&v| v * v).sum::<u128>();
        assert_eq!(sum, n, "{n} = {a}² + {b}² + {c}² + {d}²");
    }

    #[test]
    fn every_integer_below_twenty_thousand_decomposes() {
        (0..20_000u128).for_each(check);
    }

    #[test]
    fn large_integers_decompose() {
        let mut x = 0x9e37_79b9_7f4a_7c15_u64;
        for _ in 0..2_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            check(u128::from(x >> 1));
            check(u128::from(x >> 20));
            check((u128::from(x) << 36) | u128::from(x >> 28));
        }
        for n in
            [u128::from(u64::MAX >> 1), (1 << 62) - 1, 7 << 60, (1 << 100) - 1, 7 << 98, 4u128.pow(49) * 7]
        {
            check(n);
        }
    }

    #[test]
    fn primality_agrees_with_trial_division() {
        let trial = |n: u64| n >= 2 && (2..).take_while(|d| d * d <= n).all(|d| n % d != 0);
        for n in 0..50_000 {
            assert_eq!(is_prime(n), trial(n), "{n}");
        }
        // Strong pseudoprimes to small bases, and known large primes.
        for composite in [3_215_031_751u64, 3_825_123_056_546_413_051] {
            assert!(!is_prime(composite), "{composite}");
        }
        assert!(is_prime((1 << 61) - 1));
        assert!(!is_prime(((1u64 << 31) - 1) * ((1 << 31) - 1)));
    }
}
