/* The job a shard serves: an identity fixed once (--job-id, the restored
 * checkpoint, or the first Create that names one) and written into every
 * checkpoint, so that a checkpoint volume reused by another job is refused
 * instead of silently resuming that job's weights (shard.h). */
#include <stdio.h>
#include <string.h>

#include "checkpoint.h"
#include "internal.h"

int fps_shard_job_claim(fps_shard_t *sh, const char *job, char *why, size_t wl) {
  if (!job || !*job) return 0;
  if (fps_ckpt_job_check(job) < 0) {
    snprintf(why, wl, "Create: job_id '%.80s' is not 1..%d bytes of [A-Za-z0-9._:-]", job, FPS_CKPT_JOB_MAX);
    return FPS_EINVAL;
  }
  int rc = 0;
  pthread_mutex_lock(&sh->job_mu);
  if (!sh->job_id[0]) {
    snprintf(sh->job_id, sizeof sh->job_id, "%s", job);
    snprintf(sh->job_from, sizeof sh->job_from, "the first Create");
  } else if (strcmp(sh->job_id, job) != 0) {
    rc = FPS_ESTATE;
    snprintf(why, wl,
             "Create: this shard serves job '%s' (from %s), the Create names job '%s': another job's "
             "state is not resumed (give it its own --checkpoint-dir, or move that checkpoint aside)",
             sh->job_id, sh->job_from, job);
  }
  pthread_mutex_unlock(&sh->job_mu);
  return rc;
}

void fps_shard_job_get(fps_shard_t *sh, char *out, size_t len) {
  pthread_mutex_lock(&sh->job_mu);
  snprintf(out, len, "%s", sh->job_id);
  pthread_mutex_unlock(&sh->job_mu);
}
