//! Bring your own PyTorch model, end to end (feature `tch`: `cohort` built
//! with libtorch): a CNN scripted by the PyTorch venv of
//! `scripts/setup.sh`, `cohort layout net.pt` for the task's model, six
//! `cohort participate --model net.pt` processes over HTTP with secure
//! aggregation, and the coordinator's checkpoint loaded back into the
//! module in PyTorch with `load_state_dict` (strict), where it classifies
//! held-out Fashion-MNIST images.

#![cfg(feature = "tch")]
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use cohort_server::api::CreatedTask;
use cohort_tests::{Serve, artifacts, policy_json, scratch, spec, success};
use serde_json::{Value, json};

const MAKE_NET: &str = r#"
import torch
class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 6, 5)
        self.fc = torch.nn.Linear(6 * 12 * 12, 10)
    def forward(self, x):
        x = torch.nn.functional.max_pool2d(torch.relu(self.conv(x.view(-1, 1, 28, 28))), 2)
        return self.fc(torch.flatten(x, 1))
torch.manual_seed(3)
torch.jit.save(torch.jit.script(Net()), "net.pt")
"#;

const EVALUATE: &str = r#"
import gzip, numpy, torch
from safetensors.torch import load_file
module = torch.jit.load("net.pt")
module.load_state_dict(load_file("latest.safetensors"), strict=True)
def idx(path, offset):
    with gzip.open(path) as f:
        return numpy.frombuffer(f.read(), dtype=numpy.uint8, offset=offset)
d = "/usr/share/datasets/fashion-mnist/"
images = idx(d + "t10k-images-idx3-ubyte.gz", 16).reshape(-1, 784).astype(numpy.float32) / 255.0
labels = idx(d + "t10k-labels-idx1-ubyte.gz", 8)
with torch.no_grad():
    predicted = module(torch.from_numpy(images)).argmax(dim=1).numpy()
print(f"{(predicted == labels).mean():.4f}")
"#;

fn torch_python() -> PathBuf {
    std::env::var_os("COHORT_TORCH_VENV")
        .map_or_else(|| PathBuf::from("/var/tmp/cohort-torch-venv"), PathBuf::from)
        .join("bin/python")
}

fn python_file(dir: &Path, name: &str, script: &str) -> String {
    std::fs::write(dir.join(name), script).unwrap();
    let output = Command::new(torch_python()).arg(name).current_dir(dir).output().unwrap();
    success(name, &output)
}

/// Participant processes, killed if still running when dropped.
struct Participants(Vec<Child>);

impl Drop for Participants {
    fn drop(&mut self) {
        for child in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

#[test]
fn torchscript_participants_train_a_task_whose_checkpoint_loads_with_load_state_dict() {
    let dir = scratch("torchscript-participants");
    let cohort = &artifacts().cohort;
    python_file(&dir, "make_net.py", MAKE_NET);
    let run = |args: &[&str]| {
        success("cohort", &Command::new(cohort).args(args).current_dir(&dir).output().unwrap())
    };
    let model: Value = serde_json::from_str(&run(&["layout", "net.pt"])).unwrap();
    assert_eq!(model["architecture"], "torchscript:net");
    let names: Vec<&str> =
        model["layout"]["tensors"].as_array().unwrap().iter().map(|t| t["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["conv.weight", "conv.bias", "fc.weight", "fc.bias"]);
    run(&[
        "partition",
        "--dataset",
        "fashion-mnist",
        "--clients",
        "6",
        "--partition",
        "dirichlet:0.5",
        "--out",
        "shards",
    ]);

    let serve = Serve::in_dir(&dir, "admin-token-for-torchscript");
    let mut task = spec(6, 4);
    task["name"] = json!("torchscript");
    task["model"] = model;
    // Local training happens before the keys are advertised.
    task["deadlines"]["advertise_keys_ms"] = json!(600_000);
    let policy = policy_json(&task);
    let CreatedTask { id, enrollment_token: token, .. } = serve.admin().create_task(&task);
    let mut participants = Participants(Vec::new());
    for k in 0..6 {
        let log = std::fs::File::create(dir.join(format!("client-{k}.log"))).unwrap();
        let child = Command::new(cohort)
            .args(["participate", "--server", &serve.url, "--task", &id, "--token", &token])
            .arg("--shard")
            .arg(dir.join(format!("shards/{k}")))
            .args(["--index", &k.to_string(), "--model", "net.pt", "--epochs", "1", "--policy", &policy])
            .current_dir(&dir)
            // Six libtorch processes share the machine's cores.
            .env("OMP_NUM_THREADS", "1")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        participants.0.push(child);
    }
    let deadline = Instant::now() + Duration::from_secs(600);
    for (k, child) in participants.0.iter_mut().enumerate() {
        let status = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break status;
            }
            assert!(Instant::now() < deadline, "participant {k} still running after 10 minutes");
            std::thread::sleep(Duration::from_millis(200));
        };
        let log = std::fs::read_to_string(dir.join(format!("client-{k}.log"))).unwrap();
        assert!(status.success() && log.contains("the task is over"), "participant {k}: {status}\n{log}");
    }
    let rounds = serve.admin().rounds(&id);
    let survivors: Vec<i64> = rounds.iter().map(|r| r.survivors).collect();
    assert_eq!(survivors, [6, 6], "{rounds:?}");

    let (status, bytes) = serve.admin().send("GET", &format!("/admin/tasks/{id}/checkpoints/latest"), &[]);
    assert_eq!(status, 200);
    std::fs::write(dir.join("latest.safetensors"), bytes).unwrap();
    let accuracy: f64 = python_file(&dir, "evaluate.py", EVALUATE).trim().parse().unwrap();
    // Two rounds of one local epoch each: far above chance (10 %).
    assert!(accuracy > 0.6, "test accuracy {accuracy}");
    drop(participants);
    drop(serve);
    std::fs::remove_dir_all(&dir).unwrap();
}
