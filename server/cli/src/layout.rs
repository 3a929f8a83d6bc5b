//! `cohort layout`: the `model` object of a task spec (architecture,
//! layout, initialization) for a built-in architecture or a TorchScript
//! module, to put in `POST /admin/tasks`. A TorchScript module's layout is
//! its named parameters, so the coordinator's checkpoints load back into it
//! with `load_state_dict`.

use anyhow::{Result, anyhow};
use clap::Args;
use cohort_client::checkpoint::ModelLayout;
use cohort_client::model::Model;
#[cfg(feature = "tch")]
use cohort_client::model::TorchDevice;
use cohort_server::spec::{ModelInit, ModelSpec};

#[derive(Debug, Args)]
pub struct LayoutArgs {
    /// logreg, 2nn, cnn, or a TorchScript module saved with
    /// `torch.jit.save` (a path ending in .pt; needs the `tch` feature).
    model: String,
    /// Input features per example.
    #[arg(long, default_value_t = 784)]
    inputs: usize,
    /// Classes.
    #[arg(long, default_value_t = 10)]
    classes: usize,
    /// Seed of the fan-in initialization the task draws its first model
    /// with.
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

pub fn run(args: &LayoutArgs) -> Result<()> {
    let (architecture, layout) = if is_torchscript(&args.model) {
        let name = std::path::Path::new(&args.model).file_stem().and_then(|s| s.to_str()).unwrap_or("module");
        (format!("torchscript:{name}"), torchscript_layout(args)?)
    } else {
        (args.model.clone(), built_in(&args.model, args.inputs, args.classes)?.layout())
    };
    let spec = ModelSpec { architecture, layout, init: ModelInit::FanIn { seed: args.seed } };
    println!("{}", serde_json::to_string_pretty(&spec)?);
    Ok(())
}

/// Whether `--model` names a TorchScript module (a `.pt` file) rather
/// than a built-in architecture.
pub(crate) fn is_torchscript(model: &str) -> bool {
    model.ends_with(".pt")
}

/// The built-in architecture `name` for `inputs` features and `classes`
/// classes, or an error listing what `--model` takes.
pub(crate) fn built_in(name: &str, inputs: usize, classes: usize) -> Result<Model> {
    Model::by_name(name, inputs, classes)
        .ok_or_else(|| anyhow!("unknown model {name}: logreg, 2nn, cnn or a TorchScript file (.pt)"))
}

#[cfg(feature = "tch")]
fn torchscript_layout(args: &LayoutArgs) -> Result<ModelLayout> {
    let model = cohort_client::model::TorchScriptModel::load(
        &args.model,
        args.inputs,
        args.classes,
        TorchDevice::Cpu,
    )
    .map_err(|e| anyhow!("{}: {e}", args.model))?;
    Ok(model.layout().clone())
}

#[cfg(not(feature = "tch"))]
fn torchscript_layout(args: &LayoutArgs) -> Result<ModelLayout> {
    Err(no_libtorch(&args.model))
}

/// What a build without libtorch says of a TorchScript module.
#[cfg(not(feature = "tch"))]
pub(crate) fn no_libtorch(model: &str) -> anyhow::Error {
    anyhow!(
        "{model} is a TorchScript module: this cohort was built without libtorch (build it with `--features tch`)"
    )
}
