/*
 * Driven by tests/tests/e2e/mobile.rs against a running `cohort serve`: a C
 * client takes part in round 1 of a task through include/cohort.h together
 * with native clients, with its update computed by a callback; then pause
 * and resume, and the error paths of the ABI.
 *
 * Usage: round URL TASK TOKEN DIR POLICY_JSON [async]. With `async` the task
 * is an async one: the update is trained from version 0 and the outcome
 * names the group's number instead of round 1. Exits non-zero on any
 * failed check.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cohort.h"

#define CHECK(condition, ...)                                       \
    do {                                                            \
        if (!(condition)) {                                         \
            fprintf(stderr, "check failed (line %d): ", __LINE__);  \
            fprintf(stderr, __VA_ARGS__);                           \
            fprintf(stderr, "\n");                                  \
            exit(1);                                                \
        }                                                           \
    } while (0)

/* The C client's update; mirrored by the Rust test. */
static int32_t update(void *user_data, uint64_t round, const float *global, size_t parameters, float *delta,
                      uint32_t *examples) {
    int *calls = user_data;
    (void)global;
    (*calls)++;
    for (size_t j = 0; j < parameters; j++) {
        delta[j] = 0.03f * (float)(j % 4) - 0.01f * (float)round;
    }
    *examples = 9;
    return 0;
}

static const char *last_error(void) {
    static char message[512];
    cohort_last_error(message, sizeof message);
    return message;
}

int main(int argc, char **argv) {
    CHECK(argc == 6 || (argc == 7 && strcmp(argv[6], "async") == 0),
          "usage: round URL TASK TOKEN DIR POLICY_JSON [async]");
    const bool buffered = argc == 7;
    CohortConfig config = {argv[1], argv[2], argv[3], argv[4], NULL, argv[5]};
    CohortClient *client = NULL;

    /* Error paths: null pointers and bad strings are invalid arguments. */
    CHECK(cohort_client_open(NULL, &client) == COHORT_STATUS_INVALID_ARGUMENT, "null config");
    CHECK(strstr(last_error(), "null") != NULL, "message: %s", last_error());
    CohortConfig no_url = config;
    no_url.server_url = "";
    CHECK(cohort_client_open(&no_url, &client) == COHORT_STATUS_INVALID_ARGUMENT, "empty URL");
    CHECK(strcmp(cohort_status_name(COHORT_STATUS_PAUSED), "paused") == 0, "status names");
    CHECK(cohort_client_pause(NULL) == COHORT_STATUS_INVALID_ARGUMENT, "null handle");
    CohortConfig bad_policy = config;
    bad_policy.policy_json = "{\"min_clients\": -1}";
    CHECK(cohort_client_open(&bad_policy, &client) == COHORT_STATUS_INVALID_ARGUMENT, "a malformed policy");
    CHECK(strstr(last_error(), "policy") != NULL, "message: %s", last_error());
    CHECK(strcmp(cohort_status_name(COHORT_STATUS_POLICY_REFUSED), "policy_refused") == 0, "status names");

    CHECK(cohort_client_open(&config, &client) == COHORT_STATUS_OK, "open: %s", last_error());
    float features[4] = {0};
    int32_t labels[2] = {0, 300};
    CHECK(cohort_client_set_training_data(client, features, 2, 2, labels) == COHORT_STATUS_INVALID_ARGUMENT,
          "labels above 255 are refused");

    int calls = 0;
    CohortRoundResult result;
    CohortStatus status = cohort_client_participate(client, update, &calls, &result);
    CHECK(status == COHORT_STATUS_OK, "participate: %s: %s", cohort_status_name(status), last_error());
    CHECK(result.outcome == COHORT_OUTCOME_COMPLETED && (buffered ? result.round > 0 : result.round == 1),
          "outcome %d, round %llu",
          (int)result.outcome, (unsigned long long)result.round);
    /* Both ways; the upload carries the input's norm proof, so it may be the larger. */
    CHECK(calls == 1 && result.bytes_up > 0 && result.bytes_down > 0, "calls %d", calls);

    size_t length = 0;
    CHECK(cohort_client_global_model(client, NULL, 0, &length) == COHORT_STATUS_INVALID_ARGUMENT && length == 15,
          "the model size is reported (%zu)", length);
    float model[15];
    CHECK(cohort_client_global_model(client, model, 15, &length) == COHORT_STATUS_OK, "%s", last_error());

    bool paused = true;
    CHECK(cohort_client_is_paused(client, &paused) == COHORT_STATUS_OK && !paused, "not paused");
    CHECK(cohort_client_pause(client) == COHORT_STATUS_OK, "pause: %s", last_error());
    CHECK(cohort_client_participate(client, update, &calls, &result) == COHORT_STATUS_PAUSED, "paused");
    cohort_client_free(client);

    CHECK(cohort_client_open(&config, &client) == COHORT_STATUS_OK, "reopen: %s", last_error());
    CHECK(cohort_client_is_paused(client, &paused) == COHORT_STATUS_OK && paused, "the pause is persisted");
    CHECK(cohort_client_resume(client) == COHORT_STATUS_OK, "resume: %s", last_error());
    CHECK(cohort_client_is_paused(client, &paused) == COHORT_STATUS_OK && !paused, "resumed");
    cohort_client_free(client);
    printf("C OK\n");
    return 0;
}
