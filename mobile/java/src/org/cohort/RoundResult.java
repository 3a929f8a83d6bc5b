package org.cohort;

/** How one call to {@link CohortClient#participate()} ended. */
public final class RoundResult {
    /** The outcomes, in the order of the C ABI's CohortOutcome. */
    public enum Outcome {
        /** The update went into the round's aggregate. */
        COMPLETED,
        /** The server dropped this client (too slow). */
        DROPPED,
        /** This client gave up on the round; see {@link #reason()}. */
        ABANDONED,
        /** The task is over; there will be no more rounds. */
        TASK_FINISHED,
        /**
         * This client refused the round before revealing anything (a replay,
         * or not the round it was selected for); see {@link #reason()}.
         */
        REFUSED
    }

    private final Outcome outcome;
    private final long round;
    private final long bytesUp;
    private final long bytesDown;
    private final String reason;

    // Called by the native library.
    RoundResult(int outcome, long round, long bytesUp, long bytesDown, String reason) {
        this.outcome = Outcome.values()[outcome];
        this.round = round;
        this.bytesUp = bytesUp;
        this.bytesDown = bytesDown;
        this.reason = reason;
    }

    public Outcome outcome() {
        return outcome;
    }

    /** The round number (0 when the task was over). */
    public long round() {
        return round;
    }

    /** Bytes this client sent in the round. */
    public long bytesUp() {
        return bytesUp;
    }

    /** Bytes it received, the global model included. */
    public long bytesDown() {
        return bytesDown;
    }

    /** Why the round was abandoned or refused, or null. */
    public String reason() {
        return reason;
    }

    @Override
    public String toString() {
        return "RoundResult{" + outcome + ", round " + round + ", up " + bytesUp + " B, down " + bytesDown + " B"
                + (reason == null ? "" : ", " + reason) + "}";
    }
}
