#include "sha256.h"

#include "alloc.h"

#include <openssl/evp.h>
#include <stdlib.h>

struct fps_sha256_s {
  EVP_MD_CTX *ctx;
  int failed; /* an OpenSSL call failed: every later call fails too */
};

int fps_sha256_create(fps_sha256_t **out) {
  if (!out) return FPS_EINVAL;
  *out = NULL;
  fps_sha256_t *h = fps_calloc(1, sizeof(*h));
  if (!h) return FPS_ENOMEM;
  h->ctx = EVP_MD_CTX_new();
  if (!h->ctx) {
    fps_free(h);
    return FPS_ENOMEM;
  }
  /* EVP_sha256() is the implicitly fetched default-provider digest; Init
   * fails only if no provider offers SHA-256. */
  if (EVP_DigestInit_ex(h->ctx, EVP_sha256(), NULL) != 1) {
    EVP_MD_CTX_free(h->ctx);
    fps_free(h);
    return FPS_EUNSUPPORTED;
  }
  *out = h;
  return 0;
}

int fps_sha256_update(fps_sha256_t *h, const void *data, size_t len) {
  if (!h || h->failed || (!data && len)) return FPS_EINVAL;
  if (len == 0) return 0;
  if (EVP_DigestUpdate(h->ctx, data, len) != 1) {
    h->failed = 1;
    return FPS_EINVAL;
  }
  return 0;
}

int fps_sha256_final(fps_sha256_t *h, uint8_t out[FPS_SHA256_LEN]) {
  if (!h || h->failed || !out) return FPS_EINVAL;
  unsigned int n = 0;
  h->failed = 1; /* the context is spent either way */
  if (EVP_DigestFinal_ex(h->ctx, out, &n) != 1 || n != FPS_SHA256_LEN) return FPS_EINVAL;
  return 0;
}

void fps_sha256_destroy(fps_sha256_t *h) {
  if (!h) return;
  EVP_MD_CTX_free(h->ctx);
  fps_free(h);
}

int fps_sha256(const void *data, size_t len, uint8_t out[FPS_SHA256_LEN]) {
  fps_sha256_t *h = NULL;
  int rc = fps_sha256_create(&h);
  if (rc < 0) return rc;
  rc = fps_sha256_update(h, data, len);
  if (rc == 0) rc = fps_sha256_final(h, out);
  fps_sha256_destroy(h);
  return rc;
}

void fps_sha256_hex(const uint8_t digest[FPS_SHA256_LEN], char hex[FPS_SHA256_HEX_LEN + 1]) {
  static const char digits[] = "0123456789abcdef";
  for (int i = 0; i < FPS_SHA256_LEN; i++) {
    hex[2 * i] = digits[digest[i] >> 4];
    hex[2 * i + 1] = digits[digest[i] & 15];
  }
  hex[FPS_SHA256_HEX_LEN] = '\0';
}
