package org.cohort;

/** Computes the app's own update for a round, instead of the built-in trainer. */
@FunctionalInterface
public interface UpdateProvider {
    /**
     * Called on the thread of {@link CohortClient#participate(UpdateProvider)}
     * once the round's global model has arrived.
     *
     * @param round the round number
     * @param globalModel the global model's parameters, flat, in the task's layout
     * @return the update (local model minus {@code globalModel}) and its weight;
     *     throwing abandons the round
     */
    LocalUpdate computeUpdate(long round, float[] globalModel) throws Exception;
}
