package org.cohort;

import java.util.Objects;

/** An update computed by the app: local model minus global model, and its weight. */
public final class LocalUpdate {
    // Read by the native library.
    private final float[] delta;
    private final int examples;

    /**
     * @param delta local minus global parameters, as many as the global model has
     * @param examples the weight in the average: the number of local examples (positive)
     */
    public LocalUpdate(float[] delta, int examples) {
        this.delta = Objects.requireNonNull(delta, "delta").clone();
        if (examples <= 0) {
            throw new IllegalArgumentException("examples must be positive");
        }
        this.examples = examples;
    }

    public float[] delta() {
        return delta.clone();
    }

    public int examples() {
        return examples;
    }
}
