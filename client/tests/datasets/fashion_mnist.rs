//! The real Fashion-MNIST, as Debian's `dataset-fashion-mnist` installs it
//! (`scripts/setup.sh` installs the package): sizes, shapes and the class
//! balance the data set is known for, and McMahan et al.'s shard split.

use std::path::Path;

use cohort_client::data::{DataError, Dataset, load_mnist_like};
use cohort_client::partition::{Scheme, histogram, partition};

/// Where Debian's package installs it.
fn load_fashion_mnist() -> Result<(Dataset, Dataset), DataError> {
    load_mnist_like(
        Path::new("/usr/share/datasets/fashion-mnist"),
        "Fashion-MNIST",
        "scripts/setup.sh installs it",
    )
}

#[test]
fn fashion_mnist_loads_with_its_known_shape_and_balance() {
    let (train, test) = load_fashion_mnist().unwrap();
    assert_eq!((train.len(), test.len()), (60_000, 10_000));
    assert_eq!(train.shape, [28, 28]);
    assert_eq!(train.features.dim(), (60_000, 784));
    let all: Vec<usize> = (0..train.len()).collect();
    assert_eq!(histogram(&train.labels, &all, 10), vec![6_000; 10]);
    let all: Vec<usize> = (0..test.len()).collect();
    assert_eq!(histogram(&test.labels, &all, 10), vec![1_000; 10]);
    assert!(train.features.iter().all(|p| (0.0..=1.0).contains(p)));
    let mean = train.features.mean().unwrap();
    assert!((0.2..0.4).contains(&mean), "mean pixel {mean}");

    // McMahan et al.: 100 clients, 2 shards of 300 each.
    let parts = partition(&train.labels, 10, 100, Scheme::Shards { per_client: 2 }, 1).unwrap();
    assert!(parts.iter().all(|p| p.len() == 600));
    let two_or_fewer = parts
        .iter()
        .filter(|p| histogram(&train.labels, p, 10).iter().filter(|&&c| c > 0).count() <= 2)
        .count();
    assert_eq!(two_or_fewer, 100, "6000 examples per class make every shard single-label");
}

/// One epoch of logistic regression on the real data: Fashion-MNIST's
/// linear baseline is about 84 % test accuracy.
#[test]
fn logistic_regression_learns_fashion_mnist() {
    use cohort_client::model::Model;
    use cohort_client::train::{TrainConfig, train};
    let (train_set, test_set) = load_fashion_mnist().unwrap();
    let model = Model::by_name("logreg", 784, 10).unwrap();
    let mut params = model.init(1);
    let global = params.clone();
    let (_, before) = model.evaluate(&params, test_set.features.view(), &test_set.labels);
    let config = TrainConfig { epochs: 1, batch_size: 32, learning_rate: 0.1, ..TrainConfig::default() };
    train(&model, &mut params, &global, train_set.features.view(), &train_set.labels, &config).unwrap();
    let (loss, accuracy) = model.evaluate(&params, test_set.features.view(), &test_set.labels);
    assert!(before < 0.3, "untrained accuracy {before}");
    assert!(accuracy > 0.80 && loss < 0.6, "test accuracy {accuracy}, loss {loss}");
}

/// The CNN learns from half the training set in one epoch.
#[test]
fn the_cnn_learns_fashion_mnist() {
    use cohort_client::model::Model;
    use cohort_client::train::{TrainConfig, train};
    let (train_set, test_set) = load_fashion_mnist().unwrap();
    let subset = train_set.subset(&(0..30_000).collect::<Vec<_>>());
    let model = Model::by_name("cnn", 784, 10).unwrap();
    let mut params = model.init(3);
    let global = params.clone();
    let config = TrainConfig {
        epochs: 1,
        batch_size: 10,
        learning_rate: 0.02,
        momentum: 0.9,
        ..TrainConfig::default()
    };
    train(&model, &mut params, &global, subset.features.view(), &subset.labels, &config).unwrap();
    let (loss, accuracy) = model.evaluate(&params, test_set.features.view(), &test_set.labels);
    assert!(accuracy > 0.80 && loss < 0.6, "test accuracy {accuracy}, loss {loss}");
}
