/* Per-push settings: the stream header's job checks (worker count, mode),
 * each TensorPush's learning rate and weight decay, and the agreement of a
 * sync round's members: plain checks returning FPS_E* with a message,
 * called by the push path (push.c) and the sync rounds (sync.c).
 *
 * The tensor's Create settings stay its defaults; a push's values apply to
 * that update only (see TensorPush in the proto). */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

int fps_push_header_check(const fps_shard_opts_t *cfg, uint32_t worker_id, uint32_t num_workers,
                          int expect_mode, char *why, size_t why_len) {
  if (expect_mode != 0 && expect_mode != cfg->mode) {
    const char *want = expect_mode >= FPS_MODE_SYNC && expect_mode <= FPS_MODE_SSP ? fps_mode_name(expect_mode)
                                                                                    : "unknown";
    snprintf(why, why_len,
             "the worker expects consistency mode %s (%d) but this shard runs in %s mode "
             "(--mode); start the shards and the workers with the same mode",
             want, expect_mode, fps_mode_name(cfg->mode));
    return FPS_ESTATE;
  }
  if (cfg->mode == FPS_MODE_ASYNC) return 0;
  if (num_workers != 0 && num_workers != cfg->workers) {
    snprintf(why, why_len,
             "worker %u says the job has %u workers, but this %s shard expects %u (--workers); "
             "start every worker and shard with the same worker count",
             worker_id, num_workers, fps_mode_name(cfg->mode), cfg->workers);
    return FPS_ESTATE;
  }
  if (worker_id >= cfg->workers) {
    snprintf(why, why_len, "worker id %u is beyond the %u workers this shard expects (--workers; ids 0..%u)",
             worker_id, cfg->workers, cfg->workers - 1);
    return FPS_ESTATE;
  }
  return 0;
}

int fps_push_settings_check(const fps_tensor_t *t, bool has_lr, double lr, bool has_wd, double wd,
                            char *why, size_t why_len) {
  fps_adafactor_hparams_t hp = t->hp; /* constant once the tensor exists */
  if (has_lr && hp.flavor == FPS_FLAVOR_HF && hp.relative_step) {
    snprintf(why, why_len,
             "tensor '%s': a per-push lr was sent, but the tensor is hf with relative_step=true: "
             "the relative step size decides its lr (as transformers' Adafactor); send no lr",
             t->name);
    return FPS_EHPARAM;
  }
  if (has_lr) hp.lr = lr;
  if (has_wd) hp.weight_decay = wd;
  char kwhy[256] = "";
  if (fps_adafactor_validate(&hp, kwhy, sizeof kwhy) < 0) {
    snprintf(why, why_len, "tensor '%s': invalid per-push settings: %s", t->name, kwhy);
    return FPS_EHPARAM;
  }
  return 0;
}

void fps_push_settings_resolve(fps_push_entry_t *e) {
  const fps_adafactor_hparams_t *hp = &e->t->hp;
  e->uh.lr = e->has_lr ? e->lr : hp->lr;
  e->uh.weight_decay = e->has_weight_decay ? e->weight_decay : hp->weight_decay;
}

/* Shortest of %.15g / %.17g that reads back as the same double. */
static const char *fps__num(char buf[32], double v) {
  snprintf(buf, 32, "%.15g", v);
  if (strtod(buf, NULL) != v) snprintf(buf, 32, "%.17g", v);
  return buf;
}

/* Appends "w0, w3" style lists of the workers whose flag matches. */
static size_t fps__list_workers(char *buf, size_t len, fps_push_entry_t *const *m, uint32_t W, bool no_grad) {
  size_t n = 0, k = 0;
  for (uint32_t w = 0; w < W && n < len; w++) {
    if (m[w]->no_grad != no_grad) continue;
    if (n + 24 >= len) {
      n += (size_t)snprintf(buf + n, len - n, ", ...");
      break;
    }
    n += (size_t)snprintf(buf + n, len - n, "%s%u", k++ ? ", " : "", w);
  }
  return n;
}

int fps_round_agree(const fps_tensor_t *t, fps_push_entry_t *const *m, uint32_t W, bool *all_no_grad,
                    char *why, size_t why_len) {
  uint32_t with = 0;
  bool skip = false;
  for (uint32_t w = 0; w < W; w++) {
    with += !m[w]->no_grad;
    skip |= m[w]->skip_step;
  }
  /* A worker skipping the step (AMP found an Inf) makes the round apply
   * nothing for everyone: the others' gradients are dropped, and the
   * unchanged versions in their replies tell them. */
  *all_no_grad = with == 0 || skip;
  if (skip) return 0;
  if (with != 0 && with != W) {
    char had[384] = "", lacked[384] = "";
    fps__list_workers(had, sizeof had, m, W, false);
    fps__list_workers(lacked, sizeof lacked, m, W, true);
    snprintf(why, why_len,
             "tensor '%s' step %" PRIu64 ": the workers disagree about its gradient: workers %s pushed one, "
             "workers %s said no_grad; nothing was applied (every worker must skip the same parameters)",
             t->name, t->round.step, had, lacked);
    return FPS_ESTATE;
  }
  if (with == 0) return 0; /* nothing is applied: the values do not matter */
  for (uint32_t w = 1; w < W; w++) {
    const fps_update_hp_t *a = &m[0]->uh, *b = &m[w]->uh;
    const char *what = NULL;
    double x = 0, y = 0;
    if (a->lr != b->lr) what = "lr", x = a->lr, y = b->lr;
    else if (a->weight_decay != b->weight_decay) what = "weight_decay", x = a->weight_decay, y = b->weight_decay;
    if (!what) continue;
    char xs[32], ys[32];
    snprintf(why, why_len,
             "tensor '%s' step %" PRIu64 ": the workers disagree about this update's %s: worker 0 sent %s, "
             "worker %u sent %s; nothing was applied (in sync mode every worker must use the same "
             "learning-rate schedule and weight decay)",
             t->name, t->round.step, what, fps__num(xs, x), w, fps__num(ys, y));
    return FPS_ESTATE;
  }
  return 0;
}
