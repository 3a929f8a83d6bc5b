package org.cohort;

import java.io.File;
import java.util.concurrent.ExecutorService;
import java.util.concurrent.Executors;
import java.util.concurrent.Future;
import java.util.concurrent.TimeUnit;

/**
 * Driven by tests/tests/e2e/mobile.rs against a running `cohort serve`: two JVM
 * clients (one with an app-computed update, one training on supplied data)
 * take part in round 1 of a task together with native clients; then pause,
 * restart and resume, and typed exceptions.
 *
 * <p>Arguments: server URL, task id, enrollment token, a scratch directory.
 * Exits non-zero on any failed check.
 */
public final class JvmRoundTest {
    private JvmRoundTest() {}

    /** The app-computed update of client A; mirrored by the Rust test. */
    static float[] appDelta(int parameters) {
        float[] delta = new float[parameters];
        for (int j = 0; j < parameters; j++) {
            delta[j] = 0.02f * ((j % 5) - 2);
        }
        return delta;
    }

    static final int APP_EXAMPLES = 7;

    /** Client B's training data; mirrored by the Rust test. */
    static final int ROWS = 30;
    static final int COLUMNS = 4;

    static float feature(int row, int column) {
        int label = row % 3;
        return ((label * 5 + column * 3 + row) % 7) / 7.0f;
    }

    static void check(boolean condition, String message) {
        if (!condition) {
            throw new AssertionError(message);
        }
    }

    public static void main(String[] args) throws Exception {
        String url = args[0];
        String task = args[1];
        String token = args[2];
        File scratch = new File(args[3]);
        // The policy for this small task: rounds of its size are accepted.
        String policy = args[4];
        File dirA = new File(scratch, "a");
        File dirB = new File(scratch, "b");

        typedErrors(url, task, token, scratch);

        CohortClient a = new CohortClient(url, task, token, dirA, null, policy);
        CohortClient b = new CohortClient(url, task, token, dirB, null, policy);
        check(a.participantId() == null && !a.isPaused(), "a fresh client is neither enrolled nor paused");
        float[] features = new float[ROWS * COLUMNS];
        int[] labels = new int[ROWS];
        for (int i = 0; i < ROWS; i++) {
            labels[i] = i % 3;
            for (int j = 0; j < COLUMNS; j++) {
                features[i * COLUMNS + j] = feature(i, j);
            }
        }
        b.setTrainingData(features, COLUMNS, labels);
        b.setTrainingConfig(2, 5, 0.1f);
        UpdateProvider provider = (round, global) -> new LocalUpdate(appDelta(global.length), APP_EXAMPLES);

        ExecutorService pool = Executors.newFixedThreadPool(2);
        Future<RoundResult> roundA = pool.submit(() -> a.participate(provider));
        Future<RoundResult> roundB = pool.submit(() -> b.participate());
        for (RoundResult result : new RoundResult[] {roundA.get(120, TimeUnit.SECONDS), roundB.get(120, TimeUnit.SECONDS)}) {
            System.out.println("round: " + result);
            check(result.outcome() == RoundResult.Outcome.COMPLETED, "completed: " + result);
            check(result.round() == 1, "round 1: " + result);
            // Both ways; the upload carries the input's norm proof, so it may be the larger.
            check(result.bytesUp() > 0 && result.bytesDown() > 0, "traffic: " + result);
        }
        check(a.globalModel() != null && a.globalModel().length == 15, "the global model is kept");
        check(b.lastCompletedRound() == 1, "b completed round 1");
        String idA = a.participantId();
        check(idA != null && !idA.equals(b.participantId()), "distinct participant ids");
        b.close();
        b.close();

        // Round 2 waits for five clients that never come: pause stops the
        // blocking call.
        long started = System.nanoTime();
        Future<Throwable> waiting = pool.submit(() -> {
            try {
                a.participate(provider);
                return null;
            } catch (Throwable t) {
                return t;
            }
        });
        Thread.sleep(1000);
        check(!waiting.isDone(), "participate blocks while waiting to be selected");
        a.pause();
        Throwable thrown = waiting.get(10, TimeUnit.SECONDS);
        check(thrown instanceof CohortException.Paused, "pause stops participate: " + thrown);
        System.out.println("paused after " + (System.nanoTime() - started) / 1_000_000 + " ms");
        a.close();
        try {
            a.isPaused();
            check(false, "a closed client refuses calls");
        } catch (IllegalStateException expected) {
            // closed
        }

        // The app restarts: same participant, still paused until resumed.
        try (CohortClient restarted = new CohortClient(url, task, token, dirA, null, policy)) {
            check(restarted.isPaused(), "the pause survives a restart");
            check(idA.equals(restarted.participantId()), "the enrollment survives a restart");
            check(restarted.lastCompletedRound() == 1, "the completed round survives a restart");
            try {
                restarted.participate(provider);
                check(false, "a paused client does not participate");
            } catch (CohortException.Paused expected) {
                // paused
            }
            restarted.resume();
            check(!restarted.isPaused(), "resumed");
        }
        try (CohortClient reopened = new CohortClient(url, task, token, dirA, null, policy)) {
            check(!reopened.isPaused(), "the resume is persisted too");
        }
        pool.shutdownNow();
        System.out.println("JVM OK " + idA);
    }

    /** Bad arguments and refusals arrive as the documented exceptions. */
    static void typedErrors(String url, String task, String token, File scratch) throws Exception {
        // The default policy refuses this small task at enrollment, before
        // the client takes part in anything.
        try (CohortClient strict = new CohortClient(url, task, token, new File(scratch, "strict"))) {
            strict.participate((round, global) -> new LocalUpdate(new float[global.length], 1));
            check(false, "the default policy accepts a task of a few clients");
        } catch (CohortException.PolicyRefused expected) {
            check(expected.rule().equals("min_clients"), expected.rule() + ": " + expected.getMessage());
            System.out.println("policy refused: " + expected.getMessage());
        }
        try {
            new CohortClient(url, task, token, new File(scratch, "y"), null, "{\"min_clients\": \"ten\"}").close();
            check(false, "a malformed policy is refused");
        } catch (IllegalArgumentException expected) {
            check(expected.getMessage().contains("policy"), expected.getMessage());
        }
        try {
            new CohortClient("", task, "t", new File(scratch, "x")).close();
            check(false, "an empty URL is refused");
        } catch (IllegalArgumentException expected) {
            check(expected.getMessage().contains("server URL"), expected.getMessage());
        }
        try (CohortClient client = new CohortClient(url, task, "not-the-token", new File(scratch, "wrong-token"))) {
            try {
                client.participate((round, global) -> new LocalUpdate(new float[global.length], 1));
                check(false, "a wrong token is refused");
            } catch (CohortException.Unauthorized expected) {
                System.out.println("unauthorized: " + expected.getMessage());
            }
            try {
                client.setTrainingData(new float[3], 2, new int[] {0, 1});
                check(false, "mismatched data is refused");
            } catch (IllegalArgumentException expected) {
                // 3 features for 2 rows of 2
            }
        }
        try (CohortClient client = new CohortClient(url, "no-such-task", "t", new File(scratch, "no-task"))) {
            client.participate((round, global) -> new LocalUpdate(new float[global.length], 1));
            check(false, "an unknown task is refused");
        } catch (CohortException.TaskNotFound expected) {
            System.out.println("task not found: " + expected.getMessage());
        }
        try (CohortClient client = new CohortClient(url, task, "t", new File(scratch, "no-data"))) {
            client.participate();
            check(false, "participate needs data or a provider");
        } catch (IllegalArgumentException expected) {
            // neither data nor provider
        }
    }
}
