/* SHA-256 through OpenSSL's EVP interface, behind a small factorps API.
 *
 * Why a wrapper: OpenSSL errors become FPS_E* codes here, at the boundary
 * (STYLE R3), and callers never include OpenSSL headers. */
#ifndef FPS_SHA256_H
#define FPS_SHA256_H

#include <stddef.h>
#include <stdint.h>

#include "error.h"

#define FPS_SHA256_LEN 32                       /* digest bytes */
#define FPS_SHA256_HEX_LEN (2 * FPS_SHA256_LEN) /* hex digits, without the NUL */

typedef struct fps_sha256_s fps_sha256_t;

/* Starts a digest. Returns 0, FPS_ENOMEM or FPS_EUNSUPPORTED (OpenSSL has no
 * SHA-256, e.g. a FIPS provider that failed to load). Free with
 * fps_sha256_destroy(). Not thread-safe: one context per thread. */
int fps_sha256_create(fps_sha256_t **out);
/* Feeds len bytes (len may be 0). Returns 0 or FPS_EINVAL. */
int fps_sha256_update(fps_sha256_t *h, const void *data, size_t len);
/* Finishes the digest into out[32]; the context may then only be destroyed.
 * Returns 0 or FPS_EINVAL. */
int fps_sha256_final(fps_sha256_t *h, uint8_t out[FPS_SHA256_LEN]);
/* NULL is a no-op. */
void fps_sha256_destroy(fps_sha256_t *h);

/* One-shot digest of a buffer. Returns as fps_sha256_create(). */
int fps_sha256(const void *data, size_t len, uint8_t out[FPS_SHA256_LEN]);

/* Writes the lowercase hex form of a digest and a NUL into hex[65]. */
void fps_sha256_hex(const uint8_t digest[FPS_SHA256_LEN], char hex[FPS_SHA256_HEX_LEN + 1]);

#endif
