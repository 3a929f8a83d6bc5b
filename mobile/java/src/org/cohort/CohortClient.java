package org.cohort;

import java.io.File;
import java.util.Objects;
import java.util.concurrent.locks.ReentrantReadWriteLock;

/**
 * A participant of one Cohort task: it enrolls, waits to be selected, trains
 * (or lets the app compute the update), and sends only its masked update
 * through secure aggregation.
 *
 * <p>{@link #participate()} blocks until one round ends: call it on a
 * background thread (a WorkManager worker on Android). Every other method may
 * be called from any thread; {@link #pause()} stops a running
 * {@code participate} once the request in flight returns (at most 5 s). The
 * enrollment and the paused flag live
 * in the storage directory, so a restarted app continues as the same
 * participant, still paused if it was.
 *
 * <pre>{@code
 * try (CohortClient client = new CohortClient(url, taskId, token, context.getFilesDir())) {
 *     client.setTrainingData(features, 784, labels);
 *     RoundResult result = client.participate();
 * }
 * }</pre>
 */
public final class CohortClient implements AutoCloseable {
    static {
        System.loadLibrary("cohort_mobile");
    }

    // Native calls hold the read lock; close() takes the write lock, so the
    // handle is never freed under a running call.
    private final ReentrantReadWriteLock lock = new ReentrantReadWriteLock();
    private long handle;

    /** A client trusting the web PKI's certificate authorities. */
    public CohortClient(String serverUrl, String taskId, String enrollmentToken, File storageDir)
            throws CohortException {
        this(serverUrl, taskId, enrollmentToken, storageDir, null);
    }

    /**
     * A client trusting only the CA certificate(s) in {@code caCertificatePem}
     * (null: the web PKI). Nothing is sent until {@link #participate()}.
     *
     * @throws IllegalArgumentException on empty or malformed arguments, or a
     *     storage directory that holds another task's enrollment
     * @throws CohortException.Storage when the storage directory is unusable
     */
    public CohortClient(String serverUrl, String taskId, String enrollmentToken, File storageDir,
            byte[] caCertificatePem) throws CohortException {
        this(serverUrl, taskId, enrollmentToken, storageDir, caCertificatePem, null);
    }

    /**
     * As above, with the client's client policy as JSON (null: the default,
     * for a coordinator the app does not trust: the active variant only, at
     * least 10 clients, a threshold of at least 5 that withstands 5 %
     * colluding clients). Fields left out keep their defaults, e.g.
     * {@code {"min_clients": 100}}. A task or round below it makes
     * {@link #participate()} throw {@link CohortException.PolicyRefused}
     * before anything is revealed.
     *
     * @throws IllegalArgumentException also on a policy that is not valid JSON
     */
    public CohortClient(String serverUrl, String taskId, String enrollmentToken, File storageDir,
            byte[] caCertificatePem, String policyJson) throws CohortException {
        Objects.requireNonNull(serverUrl, "serverUrl");
        Objects.requireNonNull(taskId, "taskId");
        Objects.requireNonNull(enrollmentToken, "enrollmentToken");
        Objects.requireNonNull(storageDir, "storageDir");
        handle = nativeOpen(serverUrl, taskId, enrollmentToken, storageDir.getPath(), caCertificatePem, policyJson);
    }

    /**
     * Local examples for the built-in trainer: {@code labels.length} rows of
     * {@code columns} features, row major. Copied.
     */
    public void setTrainingData(float[] features, int columns, int[] labels) {
        Objects.requireNonNull(features, "features");
        Objects.requireNonNull(labels, "labels");
        long h = acquire();
        try {
            nativeSetTrainingData(h, features, columns, labels);
        } finally {
            release();
        }
    }

    /** Local training's epochs, batch size and learning rate (defaults 1, 10, 0.05). */
    public void setTrainingConfig(int epochs, int batchSize, float learningRate) {
        long h = acquire();
        try {
            nativeSetTrainingConfig(h, epochs, batchSize, learningRate);
        } finally {
            release();
        }
    }

    /**
     * Takes part in the next round this client is selected for, training the
     * task's model on the data of {@link #setTrainingData}; blocks until the
     * round ends.
     *
     * @return the round's outcome; {@link RoundResult.Outcome#TASK_FINISHED}
     *     when the task is over
     * @throws CohortException.Paused when paused before or during the call
     * @throws CohortException.PolicyRefused when the task or a round is below
     *     the client's policy or changed since enrollment (nothing revealed)
     */
    public RoundResult participate() throws CohortException {
        return participateWith(null);
    }

    /** As {@link #participate()}, with the update computed by {@code provider}. */
    public RoundResult participate(UpdateProvider provider) throws CohortException {
        return participateWith(Objects.requireNonNull(provider, "provider"));
    }

    private RoundResult participateWith(UpdateProvider provider) throws CohortException {
        long h = acquire();
        try {
            return nativeParticipate(h, provider);
        } finally {
            release();
        }
    }

    /** Pauses, persistently; a running {@code participate} throws {@link CohortException.Paused}. */
    public void pause() throws CohortException {
        long h = acquire();
        try {
            nativePause(h);
        } finally {
            release();
        }
    }

    /** Lifts a pause. */
    public void resume() throws CohortException {
        long h = acquire();
        try {
            nativeResume(h);
        } finally {
            release();
        }
    }

    /** Whether the client is paused. */
    public boolean isPaused() {
        long h = acquire();
        try {
            return nativeIsPaused(h);
        } finally {
            release();
        }
    }

    /** The id the coordinator assigned at enrollment, or null before it. */
    public String participantId() {
        long h = acquire();
        try {
            return nativeParticipantId(h);
        } finally {
            release();
        }
    }

    /** The last round this client completed (0 before any). */
    public long lastCompletedRound() {
        long h = acquire();
        try {
            return nativeLastCompletedRound(h);
        } finally {
            release();
        }
    }

    /** The global model of the last round this client trained in, or null. */
    public float[] globalModel() {
        long h = acquire();
        try {
            return nativeGlobalModel(h);
        } finally {
            release();
        }
    }

    /**
     * Releases the native client. Waits for a running {@code participate} to
     * return (call {@link #pause()} first to stop it). Idempotent.
     */
    @Override
    public void close() {
        lock.writeLock().lock();
        try {
            if (handle != 0) {
                nativeFree(handle);
                handle = 0;
            }
        } finally {
            lock.writeLock().unlock();
        }
    }

    private long acquire() {
        lock.readLock().lock();
        if (handle == 0) {
            lock.readLock().unlock();
            throw new IllegalStateException("the client is closed");
        }
        return handle;
    }

    private void release() {
        lock.readLock().unlock();
    }

    private static native long nativeOpen(String serverUrl, String taskId, String enrollmentToken,
            String storageDir, byte[] caCertificatePem, String policyJson) throws CohortException;

    private static native void nativeFree(long handle);

    private static native void nativeSetTrainingData(long handle, float[] features, int columns, int[] labels);

    private static native void nativeSetTrainingConfig(long handle, int epochs, int batchSize, float learningRate);

    private static native RoundResult nativeParticipate(long handle, UpdateProvider provider) throws CohortException;

    private static native void nativePause(long handle) throws CohortException;

    private static native void nativeResume(long handle) throws CohortException;

    private static native boolean nativeIsPaused(long handle);

    private static native String nativeParticipantId(long handle);

    private static native long nativeLastCompletedRound(long handle);

    private static native float[] nativeGlobalModel(long handle);
}
