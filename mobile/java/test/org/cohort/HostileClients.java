package org.cohort;

import java.io.File;
import java.util.ArrayList;
import java.util.List;
import java.util.concurrent.ExecutorService;
import java.util.concurrent.Executors;
import java.util.concurrent.Future;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.TimeoutException;
import java.util.concurrent.atomic.AtomicReferenceArray;

/**
 * Driven by tests/tests/e2e/hostile_clients.rs: JVM clients run against a
 * scripted malicious coordinator until each has seen the given number of
 * round outcomes, ended with an exception, or the patience ran out. Each
 * hands in a fixed update. Prints one JSON line:
 * {@code [{"outcomes": [{"outcome": "completed", "rule": null}], "error": ..., "rule": ...}]}.
 *
 * <p>Arguments: server URL, task id, enrollment token, a scratch directory,
 * the policy (JSON), clients, rounds, patience in milliseconds.
 */
public final class HostileClients {
    private HostileClients() {}

    private static String quote(String text) {
        if (text == null) {
            return "null";
        }
        StringBuilder out = new StringBuilder("\"");
        for (char c : text.toCharArray()) {
            if (c == '"' || c == '\\') {
                out.append('\\').append(c);
            } else if (c < 0x20) {
                out.append(String.format("\\u%04x", (int) c));
            } else {
                out.append(c);
            }
        }
        return out.append('"').toString();
    }

    /** The rule a refusal names in its reason ("... (rule replay) ..."), or null. */
    private static String ruleIn(String reason) {
        if (reason == null) {
            return null;
        }
        java.util.regex.Matcher m = java.util.regex.Pattern.compile("rule (\\w+)").matcher(reason);
        return m.find() ? m.group(1) : null;
    }

    private static String ending(List<String> outcomes, String error, String rule) {
        return "{\"outcomes\": [" + String.join(", ", outcomes) + "], \"error\": " + quote(error)
                + ", \"rule\": " + quote(rule) + "}";
    }

    /** Runs one client; keeps its ending so far in {@code endings[k]}. */
    private static void run(String url, String task, String token, File dir, String policy, int rounds,
            AtomicReferenceArray<String> endings, int k) {
        List<String> outcomes = new ArrayList<>();
        String error = null;
        String rule = null;
        endings.set(k, ending(outcomes, "still waiting", null));
        try (CohortClient client = new CohortClient(url, task, token, dir, null, policy)) {
            UpdateProvider provider = (round, global) -> {
                float[] delta = new float[global.length];
                java.util.Arrays.fill(delta, 0.01f);
                return new LocalUpdate(delta, 3);
            };
            while (outcomes.size() < rounds) {
                RoundResult result = client.participate(provider);
                if (result.outcome() == RoundResult.Outcome.TASK_FINISHED) {
                    break;
                }
                String name = result.outcome().name().toLowerCase(java.util.Locale.ROOT);
                outcomes.add("{\"outcome\": " + quote(name) + ", \"rule\": " + quote(ruleIn(result.reason())) + "}");
                endings.set(k, ending(outcomes, "still waiting", null));
            }
        } catch (CohortException.PolicyRefused refused) {
            error = refused.toString();
            rule = refused.rule();
        } catch (CohortException other) {
            error = other.toString();
        }
        endings.set(k, ending(outcomes, error, rule));
    }

    public static void main(String[] args) throws Exception {
        String url = args[0];
        String task = args[1];
        String token = args[2];
        File scratch = new File(args[3]);
        String policy = args[4];
        int clients = Integer.parseInt(args[5]);
        int rounds = Integer.parseInt(args[6]);
        long patience = Long.parseLong(args[7]);
        ExecutorService pool = Executors.newFixedThreadPool(clients, runnable -> {
            Thread thread = new Thread(runnable);
            // A client still waiting when the patience runs out goes with the process.
            thread.setDaemon(true);
            return thread;
        });
        AtomicReferenceArray<String> endings = new AtomicReferenceArray<>(clients);
        List<Future<?>> running = new ArrayList<>();
        for (int k = 0; k < clients; k++) {
            File dir = new File(scratch, "client-" + k);
            int index = k;
            running.add(pool.submit(() -> run(url, task, token, dir, policy, rounds, endings, index)));
        }
        long deadline = System.nanoTime() + TimeUnit.MILLISECONDS.toNanos(patience);
        for (Future<?> client : running) {
            try {
                client.get(Math.max(1, deadline - System.nanoTime()), TimeUnit.NANOSECONDS);
            } catch (TimeoutException stillWaiting) {
                // Its ending so far is printed as it is.
            }
        }
        List<String> lines = new ArrayList<>();
        for (int k = 0; k < clients; k++) {
            String line = endings.get(k);
            lines.add(line == null ? ending(new ArrayList<>(), "never started", null) : line);
        }
        System.out.println("[" + String.join(", ", lines) + "]");
        System.out.flush();
        pool.shutdownNow();
        System.exit(0);
    }
}
