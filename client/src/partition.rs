//! Splitting a dataset among simulated clients, IID or not. Every scheme
//! is deterministic for a seed.
//!
//! * `iid`: a random permutation cut into equal parts.
//! * `shards[:S]`: McMahan et al. 2017's pathological non-IID split: sort
//!   by label, cut into clients × S equal shards (S = 2 by default), give
//!   each client S random shards, so most clients see only S labels.
//! * `dirichlet:ALPHA`: label skew as in NIID-Bench (Li et al. 2022): for
//!   each class, the share of each client is drawn from Dir(α); small α
//!   concentrates each class on few clients.
//! * `quantity:ALPHA`: quantity skew: client sizes drawn from Dir(α), labels
//!   IID.
//! * `covering:ALPHA`: label skew in which every client still holds every
//!   class: [`COVERING_EVEN_SHARE`] of each class is dealt out evenly and
//!   the rest by Dir(α) shares, so any few clients together see all the
//!   classes (the browser demo's split: three tabs must be able to learn
//!   all ten digits).

use std::str::FromStr;

use rand::seq::SliceRandom;
use rand_chacha::ChaCha20Rng;
use rand_core::{Rng, SeedableRng};

/// A partitioning scheme.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Scheme {
    /// Random equal parts.
    Iid,
    /// Sorted-by-label shards.
    Shards {
        /// Shards per client.
        per_client: usize,
    },
    /// Dirichlet label skew.
    Dirichlet {
        /// Concentration α.
        alpha: f64,
    },
    /// Dirichlet quantity skew.
    Quantity {
        /// Concentration α.
        alpha: f64,
    },
    /// Dirichlet label skew over the part of each class that is not dealt
    /// out evenly ([`COVERING_EVEN_SHARE`]): every client holds every class
    /// that has at least `clients / COVERING_EVEN_SHARE` examples.
    Covering {
        /// Concentration α.
        alpha: f64,
    },
}

/// The share of each class that `covering:ALPHA` deals out evenly: every
/// client holds at least this fraction of its equal share of each class.
pub const COVERING_EVEN_SHARE: f64 = 0.25;

/// Why a dataset could not be partitioned.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum PartitionError {
    /// The scheme string is not understood.
    #[error(
        "unknown partition {0:?} (expected iid, shards[:S], dirichlet:ALPHA, quantity:ALPHA or covering:ALPHA)"
    )]
    Unknown(String),
    /// A parameter is out of range.
    #[error("invalid partition parameter: {0}")]
    Parameter(&'static str),
    /// Too few examples for the clients.
    #[error("{examples} examples cannot give {clients} clients at least one each")]
    TooFewExamples {
        /// Examples available.
        examples: usize,
        /// Clients asked for.
        clients: usize,
    },
}

impl FromStr for Scheme {
    type Err = PartitionError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let unknown = || PartitionError::Unknown(text.to_string());
        let (name, arg) = match text.split_once(':') {
            Some((name, arg)) => (name, Some(arg)),
            None => (text, None),
        };
        let float = |arg: Option<&str>| -> Result<f64, PartitionError> {
            let alpha: f64 = arg.ok_or_else(unknown)?.parse().map_err(|_| unknown())?;
            if alpha.is_finite() && alpha > 0.0 {
                Ok(alpha)
            } else {
                Err(PartitionError::Parameter("alpha must be > 0"))
            }
        };
        match name {
            "iid" if arg.is_none() => Ok(Scheme::Iid),
            "shards" => {
                let per_client = match arg {
                    None => 2,
                    Some(a) => a.parse().map_err(|_| unknown())?,
                };
                if per_client == 0 {
                    return Err(PartitionError::Parameter("shards per client must be at least 1"));
                }
                Ok(Scheme::Shards { per_client })
            }
            "dirichlet" => Ok(Scheme::Dirichlet { alpha: float(arg)? }),
            "quantity" => Ok(Scheme::Quantity { alpha: float(arg)? }),
            "covering" => Ok(Scheme::Covering { alpha: float(arg)? }),
            _ => Err(unknown()),
        }
    }
}

/// The scheme as [`FromStr`] reads it (`dirichlet:0.5`), so that what a
/// run records can be passed back to it.
impl std::fmt::Display for Scheme {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Scheme::Iid => f.write_str("iid"),
            Scheme::Shards { per_client } => write!(f, "shards:{per_client}"),
            Scheme::Dirichlet { alpha } => write!(f, "dirichlet:{alpha}"),
            Scheme::Quantity { alpha } => write!(f, "quantity:{alpha}"),
            Scheme::Covering { alpha } => write!(f, "covering:{alpha}"),
        }
    }
}

/// Splits the examples with `labels` (classes below `classes`) among
/// `clients`; returns each client's example indices.
pub fn partition(
    labels: &[u8],
    classes: usize,
    clients: usize,
    scheme: Scheme,
    seed: u64,
) -> Result<Vec<Vec<usize>>, PartitionError> {
    if clients == 0 {
        return Err(PartitionError::Parameter("at least one client is needed"));
    }
    if labels.len() < clients {
        return Err(PartitionError::TooFewExamples { examples: labels.len(), clients });
    }
    let mut rng = ChaCha20Rng::seed_from_u64(seed);
    let n = labels.len();
    Ok(match scheme {
        Scheme::Iid => {
            let order = permutation(n, &mut rng);
            split_by_sizes(&order, &equal_sizes(n, clients))
        }
        Scheme::Shards { per_client } => {
            let total = clients * per_client;
            if n < total {
                return Err(PartitionError::TooFewExamples { examples: n, clients: total });
            }
            let mut sorted: Vec<usize> = (0..n).collect();
            sorted.sort_by_key(|&i| (labels[i], i));
            let shard_len = n / total;
            let shards = permutation(total, &mut rng);
            (0..clients)
                .map(|c| {
                    let mut indices: Vec<usize> = shards[c * per_client..(c + 1) * per_client]
                        .iter()
                        .flat_map(|&s| sorted[s * shard_len..(s + 1) * shard_len].iter().copied())
                        .collect();
                    indices.sort_unstable();
                    indices
                })
                .collect()
        }
        Scheme::Dirichlet { alpha } | Scheme::Covering { alpha } => {
            let even = if matches!(scheme, Scheme::Covering { .. }) { COVERING_EVEN_SHARE } else { 0.0 };
            let mut by_class: Vec<Vec<usize>> = vec![Vec::new(); classes];
            for i in permutation(n, &mut rng) {
                by_class[usize::from(labels[i])].push(i);
            }
            // Redraw (as NIID-Bench does) until every client gets an example.
            for _ in 0..1_000 {
                let mut parts = vec![Vec::new(); clients];
                for members in &by_class {
                    let shares: Vec<f64> = dirichlet(alpha, clients, &mut rng)
                        .into_iter()
                        .map(|share| even / clients as f64 + (1.0 - even) * share)
                        .collect();
                    for (part, chunk) in parts
                        .iter_mut()
                        .zip(split_by_sizes(members, &sizes_from_shares(members.len(), &shares)))
                    {
                        part.extend(chunk);
                    }
                }
                if parts.iter().all(|p| !p.is_empty()) {
                    parts.iter_mut().for_each(|p| p.sort_unstable());
                    return Ok(parts);
                }
            }
            return Err(PartitionError::Parameter("alpha too small for every client to get an example"));
        }
        Scheme::Quantity { alpha } => {
            let order = permutation(n, &mut rng);
            let shares = dirichlet(alpha, clients, &mut rng);
            // One example each first, the rest by the drawn shares.
            let extra = sizes_from_shares(n - clients, &shares);
            let sizes: Vec<usize> = extra.iter().map(|e| e + 1).collect();
            let mut parts = split_by_sizes(&order, &sizes);
            parts.iter_mut().for_each(|p| p.sort_unstable());
            parts
        }
    })
}

/// Per-class example counts of one client.
pub fn histogram(labels: &[u8], indices: &[usize], classes: usize) -> Vec<usize> {
    let mut counts = vec![0; classes];
    for &i in indices {
        counts[usize::from(labels[i])] += 1;
    }
    counts
}

/// Clients listed one line each in a [`summary`]; a larger population is
/// summarised.
pub const SUMMARY_LISTS_UP_TO: usize = 20;

/// A table of each client's label histogram; beyond
/// [`SUMMARY_LISTS_UP_TO`] clients, the first ten, then the spread over
/// all of them (examples per client, classes a client holds, its largest
/// class's share, and how many clients hold each class).
pub fn summary(labels: &[u8], parts: &[Vec<usize>], classes: usize) -> String {
    let mut out = format!("{:>6} {:>7} |", "client", "total");
    for class in 0..classes {
        out.push_str(&format!(" {class:>5}"));
    }
    out.push('\n');
    let listed = if parts.len() <= SUMMARY_LISTS_UP_TO { parts.len() } else { 10 };
    let histograms: Vec<Vec<usize>> = parts.iter().map(|part| histogram(labels, part, classes)).collect();
    for (client, (part, counts)) in parts.iter().zip(&histograms).enumerate().take(listed) {
        out.push_str(&format!("{client:>6} {:>7} |", part.len()));
        for count in counts {
            out.push_str(&format!(" {count:>5}"));
        }
        out.push('\n');
    }
    if listed == parts.len() {
        return out;
    }
    out.push_str(&format!("   … {} more clients. Over all {}:\n", parts.len() - listed, parts.len()));
    let sizes: Vec<f64> = parts.iter().map(|part| part.len() as f64).collect();
    let held: Vec<f64> =
        histograms.iter().map(|counts| counts.iter().filter(|&&c| c > 0).count() as f64).collect();
    let largest: Vec<f64> = histograms
        .iter()
        .zip(&sizes)
        .map(|(counts, &size)| counts.iter().copied().max().unwrap_or(0) as f64 / size.max(1.0))
        .collect();
    out.push_str(&spread("examples per client", &sizes, |v| format!("{v:.0}")));
    out.push_str(&spread("classes per client", &held, |v| format!("{v:.0}")));
    out.push_str(&spread("largest class's share", &largest, |v| format!("{:.0}%", v * 100.0)));
    out.push_str(&format!("{:>23}:", "clients holding class"));
    for class in 0..classes {
        let holders = histograms.iter().filter(|counts| counts[class] > 0).count();
        out.push_str(&format!(" {class}:{holders}"));
    }
    out.push('\n');
    out
}

/// One line of a summary: the minimum, quartiles and maximum of `values`.
fn spread(name: &str, values: &[f64], show: impl Fn(f64) -> String) -> String {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let at = |q: f64| sorted[((sorted.len() - 1) as f64 * q).round() as usize];
    format!(
        "{name:>23}: min {}, quartiles {} / {} / {}, max {}\n",
        show(at(0.0)),
        show(at(0.25)),
        show(at(0.5)),
        show(at(0.75)),
        show(at(1.0))
    )
}

fn permutation(n: usize, rng: &mut ChaCha20Rng) -> Vec<usize> {
    let mut order: Vec<usize> = (0..n).collect();
    order.shuffle(rng);
    order
}

fn equal_sizes(n: usize, parts: usize) -> Vec<usize> {
    (0..parts).map(|p| n / parts + usize::from(p < n % parts)).collect()
}

/// Sizes summing to `n`, proportional to `shares` (largest remainders).
fn sizes_from_shares(n: usize, shares: &[f64]) -> Vec<usize> {
    let exact: Vec<f64> = shares.iter().map(|s| s * n as f64).collect();
    let mut sizes: Vec<usize> = exact.iter().map(|e| e.floor() as usize).collect();
    let mut remainders: Vec<(usize, f64)> =
        exact.iter().enumerate().map(|(i, e)| (i, e - e.floor())).collect();
    remainders.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    let missing = n - sizes.iter().sum::<usize>();
    for (i, _) in remainders.into_iter().take(missing) {
        sizes[i] += 1;
    }
    sizes
}

fn split_by_sizes(items: &[usize], sizes: &[usize]) -> Vec<Vec<usize>> {
    let mut start = 0;
    sizes
        .iter()
        .map(|&size| {
            let part = items[start..start + size].to_vec();
            start += size;
            part
        })
        .collect()
}

fn uniform(rng: &mut ChaCha20Rng) -> f64 {
    // 53 random bits, never exactly 0.
    ((rng.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
}

fn normal(rng: &mut ChaCha20Rng) -> f64 {
    (-2.0 * uniform(rng).ln()).sqrt() * (2.0 * std::f64::consts::PI * uniform(rng)).cos()
}

/// Gamma(shape, 1) by Marsaglia and Tsang (2000), boosted for shape < 1.
fn gamma(shape: f64, rng: &mut ChaCha20Rng) -> f64 {
    if shape < 1.0 {
        return gamma(shape + 1.0, rng) * uniform(rng).powf(1.0 / shape);
    }
    let d = shape - 1.0 / 3.0;
    let c = 1.0 / (9.0 * d).sqrt();
    loop {
        let x = normal(rng);
        let v = (1.0 + c * x).powi(3);
        if v <= 0.0 {
            continue;
        }
        let u = uniform(rng);
        if u.ln() < 0.5 * x * x + d - d * v + d * v.ln() {
            return d * v;
        }
    }
}

/// A draw from the symmetric Dirichlet(α, …, α) over `k` categories.
fn dirichlet(alpha: f64, k: usize, rng: &mut ChaCha20Rng) -> Vec<f64> {
    let draws: Vec<f64> = (0..k).map(|_| gamma(alpha, rng)).collect();
    let total: f64 = draws.iter().sum();
    if total > 0.0 { draws.iter().map(|d| d / total).collect() } else { vec![1.0 / k as f64; k] }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 10 classes, 100 examples each, interleaved.
    fn labels() -> Vec<u8> {
        (0..1000).map(|i| (i % 10) as u8).collect()
    }

    fn assert_disjoint_within_range(parts: &[Vec<usize>], n: usize) {
        let mut seen = vec![false; n];
        for part in parts {
            for &i in part {
                assert!(!seen[i], "index {i} given twice");
                seen[i] = true;
            }
        }
    }

    #[test]
    fn schemes_parse() {
        assert_eq!("iid".parse(), Ok(Scheme::Iid));
        assert_eq!("shards".parse(), Ok(Scheme::Shards { per_client: 2 }));
        assert_eq!("shards:3".parse(), Ok(Scheme::Shards { per_client: 3 }));
        assert_eq!("dirichlet:0.5".parse(), Ok(Scheme::Dirichlet { alpha: 0.5 }));
        assert_eq!("quantity:2".parse(), Ok(Scheme::Quantity { alpha: 2.0 }));
        assert_eq!("covering:0.3".parse(), Ok(Scheme::Covering { alpha: 0.3 }));
        for text in [
            "covering:0.3",
            "iid",
            "shards:3",
            "dirichlet:0.5",
            "dirichlet:0.1",
            "quantity:2",
            "quantity:1e-7",
        ] {
            let scheme: Scheme = text.parse().unwrap();
            assert_eq!(scheme.to_string().parse::<Scheme>(), Ok(scheme), "{text}");
        }
        assert_eq!(Scheme::Dirichlet { alpha: 0.5 }.to_string(), "dirichlet:0.5");
        assert_eq!(Scheme::Shards { per_client: 2 }.to_string(), "shards:2");
        for bad in [
            "",
            "iid:1",
            "covering",
            "covering:0",
            "dirichlet",
            "dirichlet:-1",
            "dirichlet:x",
            "shards:0",
            "zipf:1",
        ] {
            assert!(bad.parse::<Scheme>().is_err(), "{bad}");
        }
    }

    #[test]
    fn iid_gives_equal_balanced_parts() {
        let labels = labels();
        let parts = partition(&labels, 10, 7, Scheme::Iid, 1).unwrap();
        assert_disjoint_within_range(&parts, 1000);
        assert_eq!(parts.iter().map(Vec::len).sum::<usize>(), 1000);
        assert!(parts.iter().all(|p| p.len() == 142 || p.len() == 143));
        assert!(parts.iter().all(|p| histogram(&labels, p, 10).iter().all(|&c| c > 0)));
    }

    #[test]
    fn shards_give_each_client_few_labels() {
        let labels = labels();
        let parts = partition(&labels, 10, 50, Scheme::Shards { per_client: 2 }, 2).unwrap();
        assert_disjoint_within_range(&parts, 1000);
        assert!(parts.iter().all(|p| p.len() == 20));
        // 100 shards of 10 over sorted labels: each shard holds one label.
        for part in &parts {
            let distinct = histogram(&labels, part, 10).iter().filter(|&&c| c > 0).count();
            assert!(distinct <= 2, "{distinct} labels");
        }
    }

    #[test]
    fn dirichlet_skew_grows_as_alpha_shrinks() {
        let labels = labels();
        let dominance = |alpha: f64| {
            let parts = partition(&labels, 10, 10, Scheme::Dirichlet { alpha }, 3).unwrap();
            assert_disjoint_within_range(&parts, 1000);
            assert_eq!(parts.iter().map(Vec::len).sum::<usize>(), 1000);
            parts
                .iter()
                .map(|p| *histogram(&labels, p, 10).iter().max().unwrap() as f64 / p.len() as f64)
                .sum::<f64>()
                / 10.0
        };
        let (skewed, mild, flat) = (dominance(0.1), dominance(1.0), dominance(100.0));
        assert!(skewed > mild && mild > flat, "{skewed} {mild} {flat}");
        assert!(flat < 0.2, "α = 100 should be close to IID: {flat}");
    }

    #[test]
    fn covering_skews_labels_but_every_client_holds_every_class() {
        let labels = labels();
        let share_of_largest = |scheme| {
            let parts = partition(&labels, 10, 10, scheme, 3).unwrap();
            assert_disjoint_within_range(&parts, 1000);
            assert_eq!(parts.iter().map(Vec::len).sum::<usize>(), 1000);
            let histograms: Vec<Vec<usize>> = parts.iter().map(|p| histogram(&labels, p, 10)).collect();
            let covered = histograms.iter().all(|h| h.iter().all(|&c| c >= 2));
            let largest =
                parts.iter().zip(&histograms).map(|(p, h)| *h.iter().max().unwrap() as f64 / p.len() as f64);
            (covered, largest.sum::<f64>() / 10.0)
        };
        // 100 examples of each class, a quarter dealt evenly: 2 or 3 each.
        let (covered, covering) = share_of_largest(Scheme::Covering { alpha: 0.3 });
        let (dirichlet_covered, dirichlet) = share_of_largest(Scheme::Dirichlet { alpha: 0.3 });
        let (_, iid) = share_of_largest(Scheme::Iid);
        assert!(covered, "a client lacks a class");
        assert!(!dirichlet_covered, "plain Dirichlet at α = 0.3 should leave some client without a class");
        assert!(covering > 1.5 * iid, "covering:0.3 should still be skewed: {covering} against IID {iid}");
        assert!(covering < dirichlet, "{covering} {dirichlet}");
    }

    #[test]
    fn quantity_skew_varies_sizes_but_not_labels() {
        let labels = labels();
        let parts = partition(&labels, 10, 10, Scheme::Quantity { alpha: 0.5 }, 4).unwrap();
        assert_disjoint_within_range(&parts, 1000);
        assert_eq!(parts.iter().map(Vec::len).sum::<usize>(), 1000);
        let sizes: Vec<usize> = parts.iter().map(Vec::len).collect();
        assert!(sizes.iter().all(|&s| s >= 1));
        assert!(sizes.iter().max().unwrap() > &(3 * sizes.iter().min().unwrap()), "{sizes:?}");
    }

    #[test]
    fn partitions_are_deterministic_per_seed() {
        let labels = labels();
        for scheme in [Scheme::Iid, Scheme::Shards { per_client: 2 }, Scheme::Dirichlet { alpha: 0.5 }] {
            let a = partition(&labels, 10, 10, scheme, 9).unwrap();
            assert_eq!(a, partition(&labels, 10, 10, scheme, 9).unwrap());
            assert_ne!(a, partition(&labels, 10, 10, scheme, 10).unwrap());
        }
    }

    #[test]
    fn impossible_requests_are_refused() {
        assert!(partition(&[0, 1], 2, 3, Scheme::Iid, 0).is_err());
        assert!(partition(&[0, 1], 2, 0, Scheme::Iid, 0).is_err());
        assert!(partition(&[0, 1, 0, 1], 2, 3, Scheme::Shards { per_client: 2 }, 0).is_err());
    }

    #[test]
    fn the_summary_lists_every_client() {
        let labels = labels();
        let parts = partition(&labels, 10, 3, Scheme::Iid, 0).unwrap();
        let text = summary(&labels, &parts, 10);
        assert_eq!(text.lines().count(), 4);
        assert!(text.lines().nth(1).unwrap().trim_start().starts_with("0     334"));
    }

    #[test]
    fn a_large_population_is_summarised() {
        // Client k holds k + 1 examples, all of class k mod 10, and client 0 two classes.
        let mut labels = Vec::new();
        let mut parts = Vec::new();
        for k in 0..1000usize {
            let first = labels.len();
            labels.extend(std::iter::repeat_n((k % 10) as u8, k + 1));
            parts.push((first..labels.len()).collect::<Vec<usize>>());
        }
        labels.push(3);
        parts[0].push(labels.len() - 1);
        let text = summary(&labels, &parts, 10);
        assert_eq!(text.lines().count(), 1 + 10 + 5, "{text}");
        assert!(text.contains("990 more clients. Over all 1000"), "{text}");
        assert!(text.contains("examples per client: min 2, quartiles 251 / 501 / 750, max 1000"), "{text}");
        assert!(text.contains("classes per client: min 1, quartiles 1 / 1 / 1, max 2"), "{text}");
        assert!(text.contains("largest class's share: min 50%,"), "{text}");
        assert!(text.contains(" 0:100 1:100 2:100 3:101 4:100"), "{text}");
    }
}
