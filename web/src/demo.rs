//! The training tab's data (`/demo`, `static/demo.js`): the MNIST digits
//! that `scripts/build-web.sh` packs, split among the tabs. Demo-only; the
//! client itself takes any data through [`Core`](crate::Core).

use cohort_client::data::{Dataset, dataset_from_idx, hold_out_per_class, parse_idx};
use cohort_client::partition::{Scheme, partition};

use crate::WebError;

/// Seed of the demo's split of the digits among tabs: every tab, and the
/// tests that recompute a tab's update, cut the same shards.
pub const DIGITS_PARTITION_SEED: u64 = 2017;

/// The demo's data for tab `shard` of `shards`: the digits (IDX images and
/// labels, as `scripts/build-web.sh` packs them) with the last seventh of
/// each digit held out as the test set, and the rest split non-IID the way
/// McMahan et al. (2017) do: sorted by label, cut into 2 × `shards`
/// pieces, two pieces per tab, so most tabs see two digits. Returns (this
/// tab's training examples, the whole test set).
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
    let parts =
        partition(&train.labels, 10, shards, Scheme::Shards { per_client: 2 }, DIGITS_PARTITION_SEED)?;
    Ok((train.subset(&parts[shard]), test))
}
