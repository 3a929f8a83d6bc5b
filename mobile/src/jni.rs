//! The native methods of the Java class `org.cohort.CohortClient`
//! (`java/src/org/cohort/CohortClient.java`).
//!
//! The Java object owns a [`MobileClient`] through a `long` handle (a
//! boxed pointer). The Java side guarantees what makes the pointer
//! dereferences here sound: it passes only a handle returned by
//! `nativeOpen` and not yet passed to `nativeFree`, and it frees a handle
//! only when no other native call on it is running (a read-write lock).
//!
//! Failures become Java exceptions: `IllegalArgumentException` for bad
//! arguments, a subclass of `org.cohort.CohortException` for everything
//! else. Panics are caught here and never unwind into the JVM.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::PathBuf;

use ::jni::JNIEnv;
use ::jni::objects::{JByteArray, JClass, JFloatArray, JIntArray, JObject, JString, JThrowable, JValue};
use ::jni::sys::{JNI_FALSE, JNI_TRUE, jboolean, jfloat, jfloatArray, jint, jlong, jobject, jstring};
use cohort_client::checkpoint::Checkpoint;
use cohort_client::runtime::{Contribution, LocalUpdate, Trainer, UpdateError};

use crate::{Config, Error, MobileClient, TrainingData};

/// Why a native method failed.
enum Failure {
    /// Thrown as the matching Java exception.
    Client(Error),
    /// A JNI call failed; a Java exception may already be pending.
    Jni(::jni::errors::Error),
}

impl From<Error> for Failure {
    fn from(error: Error) -> Self {
        Failure::Client(error)
    }
}

impl From<::jni::errors::Error> for Failure {
    fn from(error: ::jni::errors::Error) -> Self {
        Failure::Jni(error)
    }
}

/// The exception class of each error (binary names).
fn exception_class(error: &Error) -> &'static str {
    match error {
        Error::InvalidArgument(_) => "java/lang/IllegalArgumentException",
        Error::Paused => "org/cohort/CohortException$Paused",
        Error::Unreachable(_) => "org/cohort/CohortException$Unreachable",
        Error::Unauthorized(_) => "org/cohort/CohortException$Unauthorized",
        Error::TaskNotFound(_) => "org/cohort/CohortException$TaskNotFound",
        Error::Rejected { .. } => "org/cohort/CohortException$Rejected",
        Error::Protocol(_) => "org/cohort/CohortException$Protocol",
        Error::InvalidUpdate(_) => "org/cohort/CohortException$InvalidUpdate",
        Error::Storage(_) => "org/cohort/CohortException$Storage",
        Error::Internal(_) => "org/cohort/CohortException$Internal",
        Error::PolicyRefused { .. } => "org/cohort/CohortException$PolicyRefused",
    }
}

fn throw(env: &mut JNIEnv<'_>, failure: Failure) {
    if env.exception_check().unwrap_or(true) {
        // A Java exception is already pending (thrown by a JNI call): let
        // it propagate as it is.
        return;
    }
    let error = match failure {
        Failure::Client(error) => error,
        Failure::Jni(error) => Error::Internal(format!("JNI: {error}")),
    };
    let message = error.to_string();
    let thrown = match &error {
        Error::Rejected { status, code, .. } => throw_rejected(env, &message, *status, code),
        Error::PolicyRefused { rule, .. } => throw_policy_refused(env, &message, rule),
        other => env.throw_new(exception_class(other), &message),
    };
    if thrown.is_err() && !env.exception_check().unwrap_or(true) {
        // The exception class is missing (a stripped app?): fall back to a
        // class every JVM has.
        let _ = env.throw_new("java/lang/RuntimeException", &message);
    }
}

fn throw_rejected(env: &mut JNIEnv<'_>, message: &str, status: u16, code: &str) -> ::jni::errors::Result<()> {
    let message = env.new_string(message)?;
    let code = env.new_string(code)?;
    let exception = env.new_object(
        "org/cohort/CohortException$Rejected",
        "(Ljava/lang/String;ILjava/lang/String;)V",
        &[JValue::Object(&message), JValue::Int(jint::from(status)), JValue::Object(&code)],
    )?;
    env.throw(JThrowable::from(exception))
}

fn throw_policy_refused(env: &mut JNIEnv<'_>, message: &str, rule: &str) -> ::jni::errors::Result<()> {
    let message = env.new_string(message)?;
    let rule = env.new_string(rule)?;
    let exception = env.new_object(
        "org/cohort/CohortException$PolicyRefused",
        "(Ljava/lang/String;Ljava/lang/String;)V",
        &[JValue::Object(&message), JValue::Object(&rule)],
    )?;
    env.throw(JThrowable::from(exception))
}

/// Runs a native method's body: failures and panics become exceptions and
/// the method returns `fallback` (ignored by the JVM when it throws).
fn run<'local, T>(
    env: &mut JNIEnv<'local>,
    fallback: T,
    body: impl FnOnce(&mut JNIEnv<'local>) -> Result<T, Failure>,
) -> T {
    let failure = match catch_unwind(AssertUnwindSafe(|| body(env))) {
        Ok(Ok(value)) => return value,
        Ok(Err(failure)) => failure,
        Err(panic) => Failure::Client(Error::Internal(format!("panic: {}", crate::panic_message(&*panic)))),
    };
    throw(env, failure);
    fallback
}

/// The client behind a handle.
fn client<'a>(handle: jlong) -> Result<&'a MobileClient, Failure> {
    let pointer = handle as *const MobileClient;
    // SAFETY: the Java class passes only live handles from `nativeOpen`
    // (or 0, which `as_ref` turns into `None`) and frees one only when no
    // other call on it runs; the client is only ever shared.
    unsafe { pointer.as_ref() }.ok_or_else(|| Failure::Client(Error::Internal("the client is closed".into())))
}

fn string(env: &mut JNIEnv<'_>, value: &JString<'_>) -> Result<String, Failure> {
    Ok(env.get_string(value)?.into())
}

/// `static native long nativeOpen(String, String, String, String, byte[], String)`
#[unsafe(no_mangle)]
pub extern "system" fn Java_org_cohort_CohortClient_nativeOpen<'local>(
    mut env: JNIEnv<'local>,
    _class: JClass<'local>,
    server_url: JString<'local>,
    task_id: JString<'local>,
    enrollment_token: JString<'local>,
    storage_dir: JString<'local>,
    ca_certificate_pem: JByteArray<'local>,
    policy_json: JString<'local>,
) -> jlong {
    run(&mut env, 0, |env| {
        let ca_certificate_pem = if ca_certificate_pem.is_null() {
            None
        } else {
            Some(env.convert_byte_array(&ca_certificate_pem)?)
        };
        let client = MobileClient::open(Config {
            server_url: string(env, &server_url)?,
            task_id: string(env, &task_id)?,
            enrollment_token: string(env, &enrollment_token)?,
            storage_dir: PathBuf::from(string(env, &storage_dir)?),
            ca_certificate_pem,
            policy_json: if policy_json.is_null() { None } else { Some(string(env, &policy_json)?) },
            max_attempts: None,
        })?;
        Ok(Box::into_raw(Box::new(client)) as jlong)
    })
}

/// `static native void nativeFree(long)`
#[unsafe(no_mangle)]
pub extern "system" fn Java_org_cohort_CohortClient_nativeFree<'local>(
    mut env: JNIEnv<'local>,
    _class: JClass<'local>,
    handle: jlong,
) {
    run(&mut env, (), |_| {
        if handle != 0 {
            // SAFETY: the handle came from `Box::into_raw` in `nativeOpen`;
            // the Java class zeroes its copy under the write lock, so this
            // runs once and with no other call on the handle.
            drop(unsafe { Box::from_raw(handle as *mut MobileClient) });
        }
        Ok(())
    });
}

/// `static native void nativeSetTrainingData(long, float[], int, int[])`
#[unsafe(no_mangle)]
pub extern "system" fn Java_org_cohort_CohortClient_nativeSetTrainingData<'local>(
    mut env: JNIEnv<'local>,
    _class: JClass<'local>,
    handle: jlong,
    features: JFloatArray<'local>,
    columns: jint,
    labels: JIntArray<'local>,
) {
    run(&mut env, (), |env| {
        let client = client(handle)?;
        let columns = usize::try_from(columns)
            .map_err(|_| Error::InvalidArgument("the number of columns is negative".into()))?;
        let mut feature_values = vec![0.0f32; usize::try_from(env.get_array_length(&features)?).unwrap_or(0)];
        env.get_float_array_region(&features, 0, &mut feature_values)?;
        let mut label_values = vec![0i32; usize::try_from(env.get_array_length(&labels)?).unwrap_or(0)];
        env.get_int_array_region(&labels, 0, &mut label_values)?;
        client.set_training_data(TrainingData::new(feature_values, columns, &label_values)?);
        Ok(())
    });
}

/// `static native void nativeSetTrainingConfig(long, int, int, float)`
#[unsafe(no_mangle)]
pub extern "system" fn Java_org_cohort_CohortClient_nativeSetTrainingConfig<'local>(
    mut env: JNIEnv<'local>,
    _class: JClass<'local>,
    handle: jlong,
    epochs: jint,
    batch_size: jint,
    learning_rate: jfloat,
) {
    run(&mut env, (), |_| {
        let positive = |value: jint| u32::try_from(value).unwrap_or(0);
        client(handle)?.set_training_config(positive(epochs), positive(batch_size), learning_rate)?;
        Ok(())
    });
}

/// An `org.cohort.UpdateProvider` as a [`Trainer`], called on the thread
/// of `participate`.
struct JavaTrainer<'a, 'local> {
    env: &'a mut JNIEnv<'local>,
    provider: &'a JObject<'local>,
}

impl JavaTrainer<'_, '_> {
    fn call(
        &mut self,
        round: u64,
        global: &Checkpoint,
    ) -> ::jni::errors::Result<Result<LocalUpdate, UpdateError>> {
        let env = &mut *self.env;
        let length = jint::try_from(global.weights.len()).unwrap_or(jint::MAX);
        let model = env.new_float_array(length)?;
        env.set_float_array_region(&model, 0, &global.weights)?;
        let round = jlong::try_from(round).unwrap_or(jlong::MAX);
        let returned = env.call_method(
            self.provider,
            "computeUpdate",
            "(J[F)Lorg/cohort/LocalUpdate;",
            &[JValue::Long(round), JValue::Object(&model)],
        );
        let update = match returned {
            Ok(value) => value.l()?,
            Err(::jni::errors::Error::JavaException) => {
                // The app's provider threw: the round is abandoned with the
                // exception's description as the reason.
                let thrown = env.exception_occurred()?;
                env.exception_clear()?;
                let text = env.call_method(&thrown, "toString", "()Ljava/lang/String;", &[])?.l()?;
                let text: String = env.get_string(&JString::from(text))?.into();
                return Ok(Err(UpdateError::Application(format!("the update provider threw {text}"))));
            }
            Err(other) => return Err(other),
        };
        if update.is_null() {
            return Ok(Err(UpdateError::Application("the update provider returned null".into())));
        }
        let delta = JFloatArray::from(env.get_field(&update, "delta", "[F")?.l()?);
        let examples = env.get_field(&update, "examples", "I")?.i()?;
        let mut values = vec![0.0f32; usize::try_from(env.get_array_length(&delta)?).unwrap_or(0)];
        env.get_float_array_region(&delta, 0, &mut values)?;
        let Ok(examples) = u32::try_from(examples) else {
            return Ok(Err(UpdateError::Application("the update has a negative number of examples".into())));
        };
        Ok(Ok(LocalUpdate {
            delta: values,
            examples,
            metrics: cohort_client::participant::MetricValues::new(),
        }))
    }
}

impl Trainer for JavaTrainer<'_, '_> {
    fn train(&mut self, contribution: Contribution, global: &Checkpoint) -> Result<LocalUpdate, UpdateError> {
        self.call(contribution.round, global)
            .unwrap_or_else(|e| Err(UpdateError::Application(format!("JNI: {e}"))))
    }
}

/// `static native RoundResult nativeParticipate(long, UpdateProvider)`
#[unsafe(no_mangle)]
pub extern "system" fn Java_org_cohort_CohortClient_nativeParticipate<'local>(
    mut env: JNIEnv<'local>,
    _class: JClass<'local>,
    handle: jlong,
    provider: JObject<'local>,
) -> jobject {
    run(&mut env, std::ptr::null_mut(), |env| {
        let client = client(handle)?;
        let result = if provider.is_null() {
            client.participate(None)?
        } else {
            let mut trainer = JavaTrainer { env: &mut *env, provider: &provider };
            client.participate(Some(&mut trainer))?
        };
        let reason = match &result.reason {
            Some(reason) => JObject::from(env.new_string(reason)?),
            None => JObject::null(),
        };
        let long = |value: u64| JValue::Long(jlong::try_from(value).unwrap_or(jlong::MAX));
        let object = env.new_object(
            "org/cohort/RoundResult",
            "(IJJJLjava/lang/String;)V",
            &[
                JValue::Int(result.outcome as jint),
                long(result.round),
                long(result.bytes_up),
                long(result.bytes_down),
                JValue::Object(&reason),
            ],
        )?;
        Ok(object.into_raw())
    })
}

/// `static native void nativePause(long)`
#[unsafe(no_mangle)]
pub extern "system" fn Java_org_cohort_CohortClient_nativePause<'local>(
    mut env: JNIEnv<'local>,
    _class: JClass<'local>,
    handle: jlong,
) {
    run(&mut env, (), |_| Ok(client(handle)?.pause()?));
}

/// `static native void nativeResume(long)`
#[unsafe(no_mangle)]
pub extern "system" fn Java_org_cohort_CohortClient_nativeResume<'local>(
    mut env: JNIEnv<'local>,
    _class: JClass<'local>,
    handle: jlong,
) {
    run(&mut env, (), |_| Ok(client(handle)?.resume()?));
}

/// `static native boolean nativeIsPaused(long)`
#[unsafe(no_mangle)]
pub extern "system" fn Java_org_cohort_CohortClient_nativeIsPaused<'local>(
    mut env: JNIEnv<'local>,
    _class: JClass<'local>,
    handle: jlong,
) -> jboolean {
    run(&mut env, JNI_FALSE, |_| Ok(if client(handle)?.is_paused() { JNI_TRUE } else { JNI_FALSE }))
}

/// `static native String nativeParticipantId(long)`
#[unsafe(no_mangle)]
pub extern "system" fn Java_org_cohort_CohortClient_nativeParticipantId<'local>(
    mut env: JNIEnv<'local>,
    _class: JClass<'local>,
    handle: jlong,
) -> jstring {
    run(&mut env, std::ptr::null_mut(), |env| match client(handle)?.participant_id() {
        Some(id) => Ok(env.new_string(id)?.into_raw()),
        None => Ok(std::ptr::null_mut()),
    })
}

/// `static native long nativeLastCompletedRound(long)`
#[unsafe(no_mangle)]
pub extern "system" fn Java_org_cohort_CohortClient_nativeLastCompletedRound<'local>(
    mut env: JNIEnv<'local>,
    _class: JClass<'local>,
    handle: jlong,
) -> jlong {
    run(&mut env, 0, |_| Ok(jlong::try_from(client(handle)?.last_completed_round()).unwrap_or(jlong::MAX)))
}

/// `static native float[] nativeGlobalModel(long)`
#[unsafe(no_mangle)]
pub extern "system" fn Java_org_cohort_CohortClient_nativeGlobalModel<'local>(
    mut env: JNIEnv<'local>,
    _class: JClass<'local>,
    handle: jlong,
) -> jfloatArray {
    run(&mut env, std::ptr::null_mut(), |env| {
        let Some(model) = client(handle)?.global_model() else {
            return Ok(std::ptr::null_mut());
        };
        let length = jint::try_from(model.len())
            .map_err(|_| Error::Internal("the model is too large for a Java array".into()))?;
        let array = env.new_float_array(length)?;
        env.set_float_array_region(&array, 0, &model)?;
        Ok(array.into_raw())
    })
}

#[cfg(test)]
mod exception_classes {
    use super::*;

    /// Every exception the binding throws is a class of the Java sources
    /// (or the JDK's), so no error falls back to a bare RuntimeException.
    #[test]
    fn every_error_kind_has_its_java_class() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        let java = std::fs::read_to_string(root.join("java/src/org/cohort/CohortException.java")).unwrap();
        for error in Error::every_kind() {
            let class = exception_class(&error);
            if let Some(nested) = class.strip_prefix("org/cohort/CohortException$") {
                let declaration = format!("public static final class {nested} extends CohortException");
                assert!(java.contains(&declaration), "CohortException.java lacks {nested}");
            } else {
                assert!(class.starts_with("java/"), "{class} is neither ours nor the JDK's");
            }
        }
    }
}
