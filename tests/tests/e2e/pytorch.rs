//! The README's PyTorch snippet, as written: it loads a Cohort checkpoint
//! into its `nn.Module` and evaluates it on the Fashion-MNIST test set with
//! the clients' input scaling, in the PyTorch venv `scripts/setup.sh`
//! makes, and gets the accuracy the Rust model gets from the same weights.

#![allow(clippy::unwrap_used)]

use std::path::PathBuf;
use std::process::Command;

use cohort_client::checkpoint::{self, Checkpoint};
use cohort_client::data::load_idx;
use cohort_client::model::Model;
use cohort_client::runtime::local_update;
use cohort_client::train::TrainConfig;
use cohort_tests::{scratch, success, workspace_root};

/// The ```python block after the README's `evaluate.py` marker.
fn readme_snippet() -> String {
    let readme = std::fs::read_to_string(workspace_root().join("README.md")).unwrap();
    let after = readme
        .split("<!-- evaluate.py")
        .nth(1)
        .unwrap_or_else(|| panic!("the README marks no PyTorch snippet"));
    let block = after.split("```python\n").nth(1).unwrap();
    block.split("\n```").next().unwrap().to_string()
}

#[test]
fn the_readme_pytorch_snippet_evaluates_a_checkpoint_as_cohort_does() {
    let data = PathBuf::from("/usr/share/datasets/fashion-mnist");
    let test = load_idx(&data.join("t10k-images-idx3-ubyte.gz"), &data.join("t10k-labels-idx1-ubyte.gz"), 10)
        .expect("Fashion-MNIST (Debian dataset-fashion-mnist) is installed by scripts/setup.sh");
    let model = Model::by_name("2nn", 784, 10).unwrap();
    let layout = model.layout();
    // A model worth evaluating: two passes of local training over 2 000
    // training images from the fan-in initialization.
    let train =
        load_idx(&data.join("train-images-idx3-ubyte.gz"), &data.join("train-labels-idx1-ubyte.gz"), 10)
            .unwrap()
            .subset(&(0..2_000).collect::<Vec<_>>());
    let initial =
        Checkpoint { layout: layout.clone(), weights: layout.fan_in_init(11), metadata: Default::default() };
    let config = TrainConfig { epochs: 2, learning_rate: 0.1, batch_size: 20, ..TrainConfig::default() };
    let update = local_update(&model, &train, &config, 1, &initial).unwrap();
    let weights: Vec<f32> = initial.weights.iter().zip(&update.delta).map(|(w, d)| w + d).collect();
    let (_, accuracy) = model.evaluate(&weights, test.features.view(), &test.labels);
    assert!(accuracy > 0.5, "trained to {accuracy}");

    let dir = scratch("pytorch-snippet");
    let metadata = std::collections::BTreeMap::from([("cohort.round".to_string(), "3".to_string())]);
    std::fs::write(dir.join("model.safetensors"), checkpoint::encode(&layout, &weights, &metadata).unwrap())
        .unwrap();
    std::fs::write(dir.join("evaluate.py"), readme_snippet()).unwrap();
    let python = cohort_tests::torch_python();
    let run =
        Command::new(&python).arg("evaluate.py").arg("model.safetensors").current_dir(&dir).output().unwrap();
    let stdout = success("the README's evaluate.py", &run);
    let printed: f32 = stdout.trim().strip_prefix("test accuracy ").unwrap().parse().unwrap();
    // The same weights and inputs: at most a handful of the 10 000 test
    // images may go another way through float rounding.
    assert!((printed - accuracy).abs() <= 5e-4, "PyTorch {printed} vs Cohort {accuracy}");
    // The scaling is part of it: without it the same model scores otherwise.
    let unscaled = readme_snippet().replace("/ 255.0", "");
    std::fs::write(dir.join("unscaled.py"), unscaled).unwrap();
    let run =
        Command::new(&python).args(["unscaled.py", "model.safetensors"]).current_dir(&dir).output().unwrap();
    let wrong: f32 =
        success("unscaled.py", &run).trim().strip_prefix("test accuracy ").unwrap().parse().unwrap();
    assert!((wrong - accuracy).abs() > 0.02, "the scaling makes no difference: {wrong} vs {accuracy}");
    std::fs::remove_dir_all(&dir).unwrap();
}
