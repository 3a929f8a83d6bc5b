package org.cohort;

import java.io.File;
import java.util.ArrayList;
import java.util.List;
import java.util.concurrent.ExecutorService;
import java.util.concurrent.Executors;
import java.util.concurrent.Future;
import java.util.concurrent.TimeUnit;

/**
 * Driven by tests/tests/e2e/mobile.rs against a running `cohort serve`: two JVM
 * clients take part in an async task. Each is told to train, computes its
 * update in the app (from version 0), waits with it until the buffer fills
 * and completes the group it is offered.
 *
 * <p>Arguments: server URL, task id, enrollment token, a scratch directory,
 * the policy JSON. Exits non-zero on any failed check.
 */
public final class JvmAsyncTest {
    private JvmAsyncTest() {}

    /** Client k's update; mirrored by the Rust test. */
    static float[] delta(int k, int parameters) {
        float[] delta = new float[parameters];
        for (int j = 0; j < parameters; j++) {
            delta[j] = 0.01f * (k + 1) * ((j % 3) - 1);
        }
        return delta;
    }

    public static void main(String[] args) throws Exception {
        String url = args[0];
        String task = args[1];
        String token = args[2];
        File scratch = new File(args[3]);
        String policy = args[4];
        ExecutorService pool = Executors.newFixedThreadPool(2);
        List<Future<RoundResult>> runs = new ArrayList<>();
        long[] bases = {-1, -1};
        for (int k = 0; k < 2; k++) {
            final int client = k;
            CohortClient jvm = new CohortClient(url, task, token, new File(scratch, "async-" + k), null, policy);
            runs.add(pool.submit(() -> {
                try (jvm) {
                    return jvm.participate((round, global) -> {
                        bases[client] = round;
                        return new LocalUpdate(delta(client, global.length), 8);
                    });
                }
            }));
        }
        for (Future<RoundResult> run : runs) {
            RoundResult result = run.get(120, TimeUnit.SECONDS);
            System.out.println("group: " + result);
            if (result.outcome() != RoundResult.Outcome.COMPLETED || result.round() <= 0) {
                throw new AssertionError("completed a group: " + result);
            }
        }
        if (bases[0] != 0 || bases[1] != 0) {
            throw new AssertionError("trained from version 0: " + bases[0] + ", " + bases[1]);
        }
        pool.shutdown();
        System.out.println("JVM ASYNC OK");
    }
}
