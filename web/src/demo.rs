//! The training tab's data (`/demo`, `static/demo.js`): the MNIST digits
//! that `scripts/build-web.sh` packs, split among the tabs. Demo-only; the
//! client itself takes any data through [`Core`](crate::Core).

use cohort_client::data::{Dataset, dataset_from_idx, hold_out_per_class, parse_idx};
use cohort_client::partition::{Scheme, partition};

use crate::WebError;

/// Seed of the demo's split of the digits among tabs: every tab, and the
/// tests that recompute a tab's update, cut the same shards.
pub const DIGITS_PARTITION_SEED: u64 = 2017;

/// How the demo splits the digits among tabs: label skew (each tab has
/// a few digits in plenty and the others rarely) in which every tab still
/// holds every digit, so that any three tabs can learn all ten.
pub const DIGITS_SCHEME: Scheme = Scheme::Covering { alpha: 0.3 };

/// The demo's data for tab `shard` of `shards`: the digits (IDX images and
/// labels, as `scripts/build-web.sh` packs them) with the last seventh of
/// each digit held out as the test set, and the rest split non-IID by
/// [`DIGITS_SCHEME`]. Returns (this tab's training examples, the whole
/// test set).
pub fn digits_shard(
    images: &[u8],
    labels: &[u8],
    shard: usize,
    shards: usize,
) -> Result<(Dataset, Dataset), WebError> {
    if shard >= shards {
        return Err(WebError::NoShard { shard, shards });
    }
    let all = dataset_from_idx(parse_idx(images)?, parse_idx(labels)?, 10)?;
    let (train, test) = hold_out_per_class(&all, 7);
    let parts = partition(&train.labels, 10, shards, DIGITS_SCHEME, DIGITS_PARTITION_SEED)?;
    Ok((train.subset(&parts[shard]), test))
}
