//! A user's own PyTorch model: a small CNN scripted and saved by the
//! PyTorch venv of `scripts/setup.sh` trains in the client's local loop
//! (`TorchScriptModel`), its layout is the module's named parameters, and
//! the checkpoint Cohort writes loads back into the same module in PyTorch
//! with `load_state_dict`, which then computes the logits Cohort computes.

#![cfg(feature = "tch")]
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::Command;

use cohort_client::checkpoint::{self, Checkpoint};
use cohort_client::data::load_idx;
use cohort_client::model::{Differentiable, Model, TorchModel, TorchScriptError, TorchScriptModel};
use cohort_client::runtime::{Contribution, LocalTrainer, Trainer};
use cohort_client::train::{TrainConfig, train};
use tch::Device;

const MAKE_CNN: &str = r#"
import sys, torch
class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 6, 5)
        self.fc1 = torch.nn.Linear(6 * 12 * 12, 32)
        self.fc2 = torch.nn.Linear(32, 10)
    def forward(self, x):
        x = x.view(-1, 1, 28, 28)
        x = torch.nn.functional.max_pool2d(torch.relu(self.conv(x)), 2)
        return self.fc2(torch.relu(self.fc1(torch.flatten(x, 1))))
torch.manual_seed(7)
torch.jit.save(torch.jit.script(Net()), sys.argv[1])
"#;

/// Loads the checkpoint into the saved module with `load_state_dict`
/// (strict: every name and shape must match) and prints its logits for
/// the images in `inputs.bin` (little-endian f32, 784 per image).
const LOAD_STATE_DICT: &str = r#"
import sys, json, numpy, torch
from safetensors.torch import load_file
module = torch.jit.load(sys.argv[1])
module.load_state_dict(load_file(sys.argv[2]), strict=True)
x = torch.from_numpy(numpy.fromfile(sys.argv[3], dtype="<f4").reshape(-1, 784))
with torch.no_grad():
    print(json.dumps(module(x).flatten().tolist()))
"#;

fn python() -> PathBuf {
    std::env::var_os("COHORT_TORCH_VENV")
        .map_or_else(|| PathBuf::from("/var/tmp/cohort-torch-venv"), PathBuf::from)
        .join("bin/python")
}

fn run_python(dir: &Path, script: &str, args: &[&str]) -> String {
    std::fs::write(dir.join("script.py"), script).unwrap();
    let output = Command::new(python())
        .arg("script.py")
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap_or_else(|e| panic!("the PyTorch venv of scripts/setup.sh ({}): {e}", python().display()));
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    String::from_utf8(output.stdout).unwrap()
}

#[test]
fn a_scripted_cnn_trains_and_its_checkpoint_loads_back_with_load_state_dict() {
    let dir = std::env::temp_dir().join(format!("cohort-torchscript-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    run_python(&dir, MAKE_CNN, &["cnn.pt"]);
    let model = TorchScriptModel::load(dir.join("cnn.pt"), 784, 10, Device::Cpu).unwrap();

    // The layout is the module's named parameters, in order.
    let names: Vec<(&str, &[usize])> =
        model.layout().tensors.iter().map(|t| (t.name.as_str(), t.shape.as_slice())).collect();
    assert_eq!(
        names,
        [
            ("conv.weight", &[6, 1, 5, 5][..]),
            ("conv.bias", &[6][..]),
            ("fc1.weight", &[32, 864][..]),
            ("fc1.bias", &[32][..]),
            ("fc2.weight", &[10, 32][..]),
            ("fc2.bias", &[10][..]),
        ]
    );
    assert_eq!(model.parameters(), 6 * 25 + 6 + 32 * 864 + 32 + 320 + 10);

    // The gradient is the loss's: central differences agree on a few coordinates.
    let data = PathBuf::from("/usr/share/datasets/fashion-mnist");
    let train =
        load_idx(&data.join("train-images-idx3-ubyte.gz"), &data.join("train-labels-idx1-ubyte.gz"), 10)
            .expect("Fashion-MNIST (Debian dataset-fashion-mnist) is installed by scripts/setup.sh")
            .subset(&(0..2_000).collect::<Vec<_>>());
    let test = load_idx(&data.join("t10k-images-idx3-ubyte.gz"), &data.join("t10k-labels-idx1-ubyte.gz"), 10)
        .unwrap()
        .subset(&(0..500).collect::<Vec<_>>());
    let initial = model.weights().unwrap();
    let small = train.subset(&(0..16).collect::<Vec<_>>());
    let batch = small.features.view();
    let mut gradient = vec![0.0; initial.len()];
    let loss = model.loss_and_gradient(&initial, batch, &small.labels, &mut gradient);
    assert!(loss.is_finite() && loss > 1.0, "{loss}");
    for i in [0, 200, 5_000, initial.len() - 1] {
        let step = 1e-2;
        let mut moved = initial.clone();
        let mut scratch = vec![0.0; initial.len()];
        moved[i] += step;
        let up = model.loss_and_gradient(&moved, batch, &small.labels, &mut scratch);
        moved[i] -= 2.0 * step;
        let down = model.loss_and_gradient(&moved, batch, &small.labels, &mut scratch);
        let numeric = (up - down) / (2.0 * step);
        assert!(
            (numeric - gradient[i]).abs() <= 2e-3 + 0.05 * gradient[i].abs(),
            "{i}: {numeric} vs {}",
            gradient[i]
        );
    }

    // It trains: the client's local loop, from the module's own weights.
    let layout = model.layout().clone();
    let global =
        Checkpoint { layout: layout.clone(), weights: initial.clone(), metadata: Default::default() };
    let config = TrainConfig {
        epochs: 2,
        learning_rate: 0.05,
        batch_size: 20,
        momentum: 0.5,
        ..TrainConfig::default()
    };
    let mut trainer = LocalTrainer { model, data: train, config };
    let update = trainer.train(Contribution { round: 1, nonce: 0 }, &global).unwrap();
    let weights: Vec<f32> = initial.iter().zip(&update.delta).map(|(w, d)| w + d).collect();
    let logits = trainer.model.logits(&weights, test.features.view()).unwrap();
    let correct = logits
        .rows()
        .into_iter()
        .zip(&test.labels)
        .filter(|(row, label)| {
            let best = row.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).unwrap().0;
            best == usize::from(**label)
        })
        .count();
    assert!(correct > 300, "{correct} of 500 test images after training");
    // A checkpoint of another layout is refused, not trained.
    let other = Checkpoint {
        layout: cohort_client::model::Model::by_name("logreg", 784, 10).unwrap().layout(),
        weights: vec![0.0; 7_850],
        metadata: Default::default(),
    };
    assert!(trainer.train(Contribution { round: 2, nonce: 1 }, &other).is_err());

    // Cohort's checkpoint in PyTorch: load_state_dict, the same logits.
    std::fs::write(
        dir.join("model.safetensors"),
        checkpoint::encode(&layout, &weights, &Default::default()).unwrap(),
    )
    .unwrap();
    let inputs: Vec<u8> = test.features.iter().flat_map(|v| v.to_le_bytes()).collect();
    std::fs::write(dir.join("inputs.bin"), inputs).unwrap();
    let printed = run_python(&dir, LOAD_STATE_DICT, &["cnn.pt", "model.safetensors", "inputs.bin"]);
    let pytorch: Vec<f32> = serde_json::from_str(printed.trim()).unwrap();
    assert_eq!(pytorch.len(), 500 * 10);
    let worst = pytorch.iter().zip(logits.iter()).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
    assert!(worst < 1e-4, "PyTorch and Cohort logits differ by {worst}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_module_that_breaks_the_contract_is_refused_with_its_reason() {
    let dir = std::env::temp_dir().join(format!("cohort-torchscript-bad-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let script = r#"
import sys, torch
torch.jit.save(torch.jit.script(torch.nn.Linear(784, 3)), "three.pt")
class NoParameters(torch.nn.Module):
    def forward(self, x):
        return x[:, :10]
torch.jit.save(torch.jit.script(NoParameters()), "none.pt")
"#;
    run_python(&dir, script, &[]);
    let refused =
        |file: &str, inputs: usize| match TorchScriptModel::load(dir.join(file), inputs, 10, Device::Cpu) {
            Err(TorchScriptError::Contract(reason)) => reason,
            other => panic!("{file}: {other:?}"),
        };
    assert!(refused("three.pt", 784).contains("not logits [2, 10]"));
    assert!(refused("none.pt", 784).contains("no parameters"));
    // The wrong input width: libtorch's own error.
    assert!(matches!(
        TorchScriptModel::load(dir.join("three.pt"), 100, 3, Device::Cpu),
        Err(TorchScriptError::Torch(_))
    ));
    assert!(matches!(
        TorchScriptModel::load(dir.join("missing.pt"), 784, 10, Device::Cpu),
        Err(TorchScriptError::Torch(_))
    ));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A deterministic batch of inputs in [-1, 1].
fn batch(rows: usize, cols: usize, seed: u64) -> ndarray::Array2<f32> {
    use rand_chacha::ChaCha20Rng;
    use rand_core::{Rng, SeedableRng};
    let mut rng = ChaCha20Rng::seed_from_u64(seed);
    ndarray::Array2::from_shape_fn((rows, cols), |_| (rng.next_u32() as f32 / u32::MAX as f32) * 2.0 - 1.0)
}

/// The built-in models on libtorch (`TorchModel`): the same weights and
/// batch give the same loss, gradients and logits as the ndarray path,
/// within 1e-4.
#[test]
fn libtorch_and_ndarray_agree() {
    for name in ["logreg", "2nn", "cnn"] {
        let model = Model::by_name(name, 784, 10).unwrap();
        let params = model.init(11);
        let x = batch(16, 784, 12).mapv(|v| v.abs());
        let labels: Vec<u8> = (0..16).map(|i| (i * 7 % 10) as u8).collect();
        let torch = TorchModel::new(model.clone(), Device::Cpu);
        let (mut expected, mut got) = (vec![0.0; model.len()], vec![0.0; model.len()]);
        let loss = model.loss_and_gradient(&params, x.view(), &labels, &mut expected);
        let torch_loss = torch.loss_and_gradient(&params, x.view(), &labels, &mut got);
        assert!((loss - torch_loss).abs() < 1e-4, "{name}: loss {loss} vs {torch_loss}");
        let worst = expected.iter().zip(&got).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
        assert!(worst < 1e-4, "{name}: largest gradient difference {worst}");
        assert!(expected.iter().any(|g| g.abs() > 1e-3), "{name}: the gradient is not trivially zero");
        let logits = model.logits(&params, x.view());
        let torch_logits = torch.logits(&params, x.view());
        let worst = (&logits - &torch_logits).mapv(f32::abs).fold(0.0f32, |m, &v| m.max(v));
        assert!(worst < 1e-4, "{name}: logits differ by {worst}");
    }
}

/// Local training on libtorch follows the ndarray trajectory.
#[test]
fn training_on_libtorch_follows_the_ndarray_trajectory() {
    let model = Model::by_name("2nn", 784, 10).unwrap();
    let x = batch(60, 784, 3).mapv(|v| v.abs());
    let labels: Vec<u8> = (0..60).map(|i| (i % 10) as u8).collect();
    let config = TrainConfig {
        epochs: 2,
        batch_size: 10,
        learning_rate: 0.1,
        momentum: 0.5,
        ..TrainConfig::default()
    };
    let global = model.init(4);
    let (mut a, mut b) = (global.clone(), global.clone());
    train(&model, &mut a, &global, x.view(), &labels, &config).unwrap();
    train(&TorchModel::new(model, Device::Cpu), &mut b, &global, x.view(), &labels, &config).unwrap();
    let worst = a.iter().zip(&b).map(|(p, q)| (p - q).abs()).fold(0.0f32, f32::max);
    assert!(worst < 1e-4, "parameters drift apart by {worst}");
    assert_ne!(a, global);
}
