package org.cohort;

/**
 * A failure of the Cohort client. The subclasses mirror the C ABI's
 * CohortStatus; bad arguments throw {@link IllegalArgumentException} instead.
 */
public class CohortException extends Exception {
    private static final long serialVersionUID = 1L;

    public CohortException(String message) {
        super(message);
    }

    /** The client is paused; call {@link CohortClient#resume()}. */
    public static final class Paused extends CohortException {
        private static final long serialVersionUID = 1L;

        public Paused(String message) {
            super(message);
        }
    }

    /** The coordinator did not answer after every retry (offline?). */
    public static final class Unreachable extends CohortException {
        private static final long serialVersionUID = 1L;

        public Unreachable(String message) {
            super(message);
        }
    }

    /** The enrollment token or the credential was refused. */
    public static final class Unauthorized extends CohortException {
        private static final long serialVersionUID = 1L;

        public Unauthorized(String message) {
            super(message);
        }
    }

    /** The task does not exist on this coordinator. */
    public static final class TaskNotFound extends CohortException {
        private static final long serialVersionUID = 1L;

        public TaskNotFound(String message) {
            super(message);
        }
    }

    /** The coordinator refused a request. */
    public static final class Rejected extends CohortException {
        private static final long serialVersionUID = 1L;
        private final int status;
        private final String code;

        public Rejected(String message, int status, String code) {
            super(message);
            this.status = status;
            this.code = code;
        }

        /** The HTTP status. */
        public int status() {
            return status;
        }

        /** The coordinator's machine-readable error code. */
        public String code() {
            return code;
        }
    }

    /**
     * The task or a round is below the client's client policy, or changed
     * since enrollment. The client revealed nothing and stops; {@link #rule()}
     * names the rule ("variant", "min_clients", "min_threshold", "ring",
     * "transform", "pinned", ...).
     */
    public static final class PolicyRefused extends CohortException {
        private static final long serialVersionUID = 1L;
        private final String rule;

        public PolicyRefused(String message, String rule) {
            super(message);
            this.rule = rule;
        }

        /** The rule the task or round broke. */
        public String rule() {
            return rule;
        }
    }

    /** The coordinator answered something that is not its API. */
    public static final class Protocol extends CohortException {
        private static final long serialVersionUID = 1L;

        public Protocol(String message) {
            super(message);
        }
    }

    /** The app's update does not fit the round's model. */
    public static final class InvalidUpdate extends CohortException {
        private static final long serialVersionUID = 1L;

        public InvalidUpdate(String message) {
            super(message);
        }
    }

    /** The storage directory could not be read or written. */
    public static final class Storage extends CohortException {
        private static final long serialVersionUID = 1L;

        public Storage(String message) {
            super(message);
        }
    }

    /** A bug in the native library. */
    public static final class Internal extends CohortException {
        private static final long serialVersionUID = 1L;

        public Internal(String message) {
            super(message);
        }
    }
}
