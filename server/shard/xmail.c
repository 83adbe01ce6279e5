/* What a split tensor's block keeps of the Exchange between its steps
 * (internal.h): partials that arrived before this shard's own step, the
 * partials a step used (for a peer's identical retry), the attempts that
 * failed here and the last step applied. xstep.c fills and reads it;
 * xrecover.c empties it when the block moves to an agreed version. Every
 * function REQUIRES t->mu of the block whose split is passed. */
#include <string.h>

#include "alloc.h"
#include "internal.h"

static void fps__xkept_free(fps_xkept_t *k) {
  fps_free(k->wire);
  if (!k->done) fps_split_partials_free(&k->dec);
  fps_free(k);
}

static void fps__xmail_drop_all(fps_xmail_t *ml) {
  for (fps_xkept_t *k = ml->head, *n; k; k = n) {
    n = k->next;
    fps__xkept_free(k);
  }
  for (int i = 0; i < 2; i++) fps_free(ml->own[i]);
}

void fps__xmail_applied(fps_xmail_t *ml, uint64_t version, uint64_t attempt, uint8_t *own[2],
                        const size_t own_len[2], bool imaged) {
  ml->applied = true;
  ml->applied_version = version;
  ml->applied_attempt = attempt;
  ml->imaged = imaged;
  for (int i = 0; i < 2; i++) {
    fps_free(ml->own[i]);
    ml->own[i] = own[i];
    ml->own_len[i] = own[i] ? own_len[i] : 0;
    own[i] = NULL;
  }
}

void fps__xmail_free(fps_tensor_split_t *sp) {
  if (!sp->mail) return;
  fps__xmail_drop_all(sp->mail);
  fps_free(sp->mail);
  sp->mail = NULL;
}

void fps__xmail_reset(fps_tensor_split_t *sp) {
  if (!sp->mail) return;
  fps__xmail_drop_all(sp->mail);
  memset(sp->mail, 0, sizeof *sp->mail);
}

void fps__xmail_prune(fps_tensor_split_t *sp, uint64_t v) {
  if (!sp->mail) return;
  for (fps_xkept_t **pp = &sp->mail->head; *pp;) {
    fps_xkept_t *k = *pp;
    bool drop = k->done ? k->version + 1 < v : k->version < v;
    if (drop) {
      *pp = k->next;
      fps__xkept_free(k);
    } else {
      pp = &k->next;
    }
  }
}

fps_xkept_t *fps__xmail_find(fps_tensor_split_t *sp, uint64_t v, uint32_t b, int phase, uint64_t a, bool done) {
  if (!sp->mail) return NULL;
  for (fps_xkept_t *k = sp->mail->head; k; k = k->next)
    if (k->version == v && k->block == b && k->phase == phase && k->attempt == a && k->done == done) return k;
  return NULL;
}

unsigned fps__xmail_count(const fps_tensor_split_t *sp, uint64_t v, uint32_t b, int phase) {
  unsigned n = 0;
  for (const fps_xkept_t *k = sp->mail ? sp->mail->head : NULL; k; k = k->next)
    if (!k->done && k->version == v && k->block == b && k->phase == phase) n++;
  return n;
}

bool fps__xmail_failed(const fps_tensor_split_t *sp, uint64_t v, uint64_t a) {
  const fps_xmail_t *ml = sp->mail;
  if (!a || !ml || ml->failed_version != v) return false;
  for (unsigned i = 0; i < ml->nfailed; i++)
    if (ml->failed[i] == a) return true;
  return false;
}

void fps__xmail_mark(fps_tensor_split_t *sp, uint64_t v, uint64_t a, bool failed) {
  fps_xmail_t *ml = sp->mail;
  if (!a) return;
  if (ml->failed_version != v) {
    ml->failed_version = v;
    ml->nfailed = 0;
  }
  unsigned i = 0;
  while (i < ml->nfailed && ml->failed[i] != a) i++;
  if (i < ml->nfailed) { /* known: forget it, or it stays failed */
    if (failed) return;
    memmove(&ml->failed[i], &ml->failed[i + 1], (ml->nfailed - i - 1) * sizeof ml->failed[0]);
    ml->nfailed--;
    return;
  }
  if (!failed) return;
  if (ml->nfailed == FPS_XMAIL_FAILED_MAX) { /* full: the oldest goes */
    memmove(&ml->failed[0], &ml->failed[1], (FPS_XMAIL_FAILED_MAX - 1) * sizeof ml->failed[0]);
    ml->nfailed--;
  }
  ml->failed[ml->nfailed++] = a;
}
