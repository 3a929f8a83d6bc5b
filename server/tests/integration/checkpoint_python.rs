//! A checkpoint written by the coordinator loads with Python's reference
//! `safetensors` implementation (the loader PyTorch uses), with the right
//! names, shapes, values and metadata.
//!
//! Needs the venv that `scripts/setup.sh` creates (override with
//! `COHORT_PYTHON`).

#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::process::Command;

use cohort_server::checkpoint::{ModelLayout, TensorSpec, encode};

#[test]
fn python_safetensors_loads_a_checkpoint() {
    let layout = ModelLayout {
        tensors: vec![
            TensorSpec { name: "fc1.weight".into(), shape: vec![3, 2] },
            TensorSpec { name: "fc1.bias".into(), shape: vec![3] },
        ],
    };
    let weights: Vec<f32> = (0..9).map(|i| i as f32 * 0.25 - 1.0).collect();
    let metadata = BTreeMap::from([("round".to_string(), "12".to_string())]);
    let bytes = encode(&layout, &weights, &metadata).unwrap();
    let dir = std::env::temp_dir().join(format!("cohort-checkpoint-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("model.safetensors");
    std::fs::write(&file, bytes).unwrap();
    let script = r#"
import json, sys
from safetensors import safe_open
from safetensors.numpy import load_file
tensors = load_file(sys.argv[1])
with safe_open(sys.argv[1], framework="np") as f:
    meta = f.metadata()
print(json.dumps({
    "shapes": {k: list(v.shape) for k, v in tensors.items()},
    "values": {k: v.flatten().tolist() for k, v in tensors.items()},
    "dtypes": sorted({str(v.dtype) for v in tensors.values()}),
    "round": meta["round"],
}))
"#;
    let output = Command::new(cohort_tests::python()).arg("-c").arg(script).arg(&file).output().unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let seen: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(seen["shapes"]["fc1.weight"], serde_json::json!([3, 2]));
    assert_eq!(seen["shapes"]["fc1.bias"], serde_json::json!([3]));
    assert_eq!(seen["dtypes"], serde_json::json!(["float32"]));
    assert_eq!(seen["round"], "12");
    let values = |name: &str| -> Vec<f32> {
        seen["values"][name].as_array().unwrap().iter().map(|v| v.as_f64().unwrap() as f32).collect()
    };
    assert_eq!(values("fc1.weight"), weights[..6]);
    assert_eq!(values("fc1.bias"), weights[6..]);
}
