//! What a client binding keeps beside its participant: the local examples,
//! the training settings, the choice of the built-in trainer, and the pause
//! flag. The mobile and browser bindings both wrap these, so each rule
//! lives here once.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use crate::checkpoint::Checkpoint;
use crate::data::Dataset;
use crate::model::Model;
use crate::runtime::{Contribution, LocalUpdate, Trainer, UpdateError, local_update};
use crate::train::TrainConfig;

/// Training settings out of range.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("epochs and batch size must be positive, the learning rate positive and finite")]
pub struct SettingsError;

/// The local examples and settings of the built-in trainer: the task's
/// architecture, recognised from its layout ([`Model::for_layout`]),
/// trained on the application's data.
#[derive(Debug, Clone, Default)]
pub struct LocalTraining {
    data: Option<Dataset>,
    test: Option<Dataset>,
    config: TrainConfig,
}

impl LocalTraining {
    /// No data yet, the default settings (1 epoch, batch 10, learning
    /// rate 0.05).
    pub fn new() -> Self {
        Self::default()
    }

    /// Replaces the training examples.
    pub fn set_data(&mut self, data: Dataset) {
        self.data = Some(data);
    }

    /// Replaces the held-out examples each round's global model is
    /// evaluated on.
    pub fn set_test_data(&mut self, test: Dataset) {
        self.test = Some(test);
    }

    /// Whether training examples were supplied.
    pub fn has_data(&self) -> bool {
        self.data.is_some()
    }

    /// Sets epochs, batch size and learning rate; refuses zeros and a
    /// learning rate that is not positive and finite, keeping the settings
    /// in force.
    pub fn set_config(
        &mut self,
        epochs: u32,
        batch_size: u32,
        learning_rate: f32,
    ) -> Result<(), SettingsError> {
        if epochs == 0 || batch_size == 0 || !(learning_rate.is_finite() && learning_rate > 0.0) {
            return Err(SettingsError);
        }
        self.config = TrainConfig {
            epochs: epochs as usize,
            batch_size: batch_size as usize,
            learning_rate,
            ..self.config
        };
        Ok(())
    }

    /// The settings in force.
    pub fn config(&self) -> TrainConfig {
        self.config
    }

    /// The built-in architecture of the task's model.
    pub fn model_for(global: &Checkpoint) -> Result<Model, UpdateError> {
        Model::for_layout(&global.layout).ok_or(UpdateError::NotBuiltIn)
    }

    /// Accuracy of `weights` of `model` on the held-out examples, if any.
    pub fn test_accuracy(&self, model: &Model, weights: &[f32]) -> Option<f32> {
        self.test.as_ref().map(|test| model.evaluate(weights, test.features.view(), &test.labels).1)
    }

    /// The round's update: the task's architecture trained on the local
    /// examples from the global model, the training's randomness seeded
    /// from the settings' seed and `nonce`, the client's own count of its
    /// contributions ([`Action::Train`](crate::participant::Action::Train)
    /// carries it), never a number the coordinator chose.
    pub fn update(&self, nonce: u64, global: &Checkpoint) -> Result<LocalUpdate, UpdateError> {
        self.update_with(&Self::model_for(global)?, nonce, global)
    }

    /// [`update`](Self::update) with the architecture already recognised
    /// ([`model_for`](Self::model_for)).
    pub fn update_with(
        &self,
        model: &Model,
        nonce: u64,
        global: &Checkpoint,
    ) -> Result<LocalUpdate, UpdateError> {
        let data = self.data.as_ref().ok_or(UpdateError::NoData)?;
        local_update(model, data, &self.config, nonce, global)
    }
}

impl Trainer for LocalTraining {
    fn train(&mut self, contribution: Contribution, global: &Checkpoint) -> Result<LocalUpdate, UpdateError> {
        self.update(contribution.nonce, global)
    }
}

/// Whether the client is paused: shared by every handle of it (any thread
/// may raise or lower it), and kept in a file when there is one, so that a
/// restarted application is still paused.
#[derive(Debug, Clone)]
pub struct Pause {
    /// Raised while paused or interrupted: what the runner reads.
    flag: Arc<AtomicBool>,
    /// Whether paused and whether interrupted, changed together with the
    /// flag (and the file) under the lock, so that a pause and an
    /// interrupt never undo each other.
    state: Arc<Mutex<(bool, bool)>>,
    file: Option<PathBuf>,
}

impl Pause {
    /// A pause held in memory only, lowered.
    pub fn in_memory() -> Self {
        Self {
            flag: Arc::new(AtomicBool::new(false)),
            state: Arc::new(Mutex::new((false, false))),
            file: None,
        }
    }

    /// A pause kept in `file`: raised while the file exists.
    pub fn in_file(file: &Path) -> Self {
        let paused = file.exists();
        Self {
            flag: Arc::new(AtomicBool::new(paused)),
            state: Arc::new(Mutex::new((paused, false))),
            file: Some(file.to_path_buf()),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, (bool, bool)> {
        self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Raises the flag (and writes the file).
    pub fn pause(&self) -> std::io::Result<()> {
        let mut state = self.state();
        state.0 = true;
        self.flag.store(true, Ordering::SeqCst);
        match &self.file {
            Some(file) => std::fs::write(file, b"paused\n"),
            None => Ok(()),
        }
    }

    /// Lowers the pause (and removes the file); lowering a lowered flag is
    /// not an error. An interrupt under way stays raised.
    pub fn resume(&self) -> std::io::Result<()> {
        let mut state = self.state();
        if let Some(file) = &self.file {
            match std::fs::remove_file(file) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(e),
            }
        }
        state.0 = false;
        self.flag.store(state.1, Ordering::SeqCst);
        Ok(())
    }

    /// Raises the flag in memory only: a running round stops as for a
    /// pause, but nothing is written, so the client is not paused after a
    /// restart (a process that is told to stop, not to pause).
    pub fn interrupt(&self) {
        let mut state = self.state();
        state.1 = true;
        self.flag.store(true, Ordering::SeqCst);
    }

    /// Lowers what [`interrupt`](Self::interrupt) raised; a pause stays.
    pub fn clear_interrupt(&self) {
        let mut state = self.state();
        state.1 = false;
        self.flag.store(state.0, Ordering::SeqCst);
    }

    /// Whether the flag is raised (paused, or interrupted).
    pub fn is_paused(&self) -> bool {
        self.flag.load(Ordering::SeqCst)
    }

    /// The flag itself, for [`Runner::with_interrupt`](crate::runtime::Runner::with_interrupt).
    pub fn flag(&self) -> Arc<AtomicBool> {
        self.flag.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint;

    fn one_hot(rows: usize) -> Dataset {
        let features: Vec<f32> =
            (0..rows * 4).map(|i| if i % 4 == (i / 4) % 3 { 1.0 } else { 0.0 }).collect();
        let labels: Vec<u8> = (0..rows).map(|i| (i % 3) as u8).collect();
        Dataset::from_rows(features, 4, labels).unwrap()
    }

    fn global(model: &Model) -> Checkpoint {
        let bytes =
            checkpoint::encode(&model.layout(), &vec![0.0; model.len()], &Default::default()).unwrap();
        checkpoint::decode(&bytes).unwrap()
    }

    #[test]
    fn settings_are_checked_and_kept_when_refused() {
        let mut local = LocalTraining::new();
        for (epochs, batch, rate) in
            [(0, 10, 0.1), (1, 0, 0.1), (1, 10, 0.0), (1, 10, f32::NAN), (1, 10, -1.0)]
        {
            assert_eq!(local.set_config(epochs, batch, rate), Err(SettingsError));
        }
        assert_eq!(local.config(), TrainConfig::default());
        local.set_config(3, 7, 0.5).unwrap();
        let config = local.config();
        assert_eq!((config.epochs, config.batch_size, config.learning_rate), (3, 7, 0.5));
    }

    #[test]
    fn the_built_in_trainer_needs_data_and_a_built_in_architecture() {
        let model = Model::by_name("logreg", 4, 3).unwrap();
        let global = global(&model);
        let mut local = LocalTraining::new();
        assert!(matches!(local.update(1, &global), Err(UpdateError::NoData)));
        local.set_data(one_hot(15));
        local.set_test_data(one_hot(15));
        local.set_config(20, 5, 0.5).unwrap();
        let update = local.train(crate::runtime::Contribution { round: 1, nonce: 0 }, &global).unwrap();
        assert_eq!((update.examples, update.delta.len()), (15, model.len()));
        // Zeros predict one class for everything: a third right; the
        // trained model separates the one-hot classes.
        let trained: Vec<f32> = global.weights.iter().zip(&update.delta).map(|(g, d)| g + d).collect();
        assert!((local.test_accuracy(&model, &global.weights).unwrap() - 1.0 / 3.0).abs() < 1e-6);
        assert!(local.test_accuracy(&model, &trained).unwrap() > 0.99);
        let mut foreign = global.clone();
        foreign.layout.tensors[0].name = "not.a.built.in".into();
        assert!(matches!(local.update(1, &foreign), Err(UpdateError::NotBuiltIn)));
    }

    #[test]
    fn a_pause_in_a_file_outlives_its_handle() {
        let file = std::env::temp_dir().join(format!("cohort-pause-{}", std::process::id()));
        let _ = std::fs::remove_file(&file);
        let pause = Pause::in_file(&file);
        assert!(!pause.is_paused());
        let shared = pause.flag();
        pause.pause().unwrap();
        assert!(shared.load(Ordering::SeqCst) && Pause::in_file(&file).is_paused());
        pause.resume().unwrap();
        pause.resume().unwrap();
        assert!(!Pause::in_file(&file).is_paused() && !shared.load(Ordering::SeqCst));
        let memory = Pause::in_memory();
        memory.pause().unwrap();
        assert!(memory.clone().is_paused());
    }

    #[test]
    fn an_interrupt_and_a_pause_never_undo_each_other() {
        let file = std::env::temp_dir().join(format!("cohort-interrupt-{}", std::process::id()));
        let _ = std::fs::remove_file(&file);
        let pause = Pause::in_file(&file);
        let flag = pause.flag();
        // An interrupt is not kept, and lowering it lowers the flag.
        pause.interrupt();
        assert!(flag.load(Ordering::SeqCst) && !file.exists());
        pause.clear_interrupt();
        assert!(!flag.load(Ordering::SeqCst));
        // A pause during an interrupt outlives the interrupt's end.
        pause.interrupt();
        pause.pause().unwrap();
        pause.clear_interrupt();
        assert!(flag.load(Ordering::SeqCst) && file.exists());
        // A resume during an interrupt leaves the interrupt raised.
        pause.interrupt();
        pause.resume().unwrap();
        assert!(flag.load(Ordering::SeqCst), "the resume lowered an interrupt under way");
        pause.clear_interrupt();
        assert!(!flag.load(Ordering::SeqCst) && !file.exists());
    }
}
