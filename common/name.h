/* Tensor names and text that goes into status messages: the one place for
 * the name rule, shared by the shard, the client and the checkpoint format.
 *
 * A tensor name is 1..FPS_TENSOR_NAME_MAX bytes of strict UTF-8 (no
 * overlong forms, no surrogates, nothing past U+10FFFF) without control
 * characters (U+0000..U+001F, U+007F): a NUL would make "w\0evil" act on
 * "w" wherever names are C strings, and the others make logs unreadable. */
#ifndef FPS_NAME_H
#define FPS_NAME_H

#include <stdbool.h>
#include <stddef.h>

#include "fps_limits.h" /* FPS_TENSOR_NAME_MAX */

/* Length of the well-formed UTF-8 sequence at s (at most `left` bytes,
 * left >= 1), or 0 if it is not one. */
size_t fps_utf8_seq(const unsigned char *s, size_t left);

/* True if s[0..n) is strict UTF-8. */
bool fps_utf8_valid(const char *s, size_t n);

/* Checks name[0..len) against the rule above. Returns 0, or FPS_EINVAL with
 * the problem in why ("tensor name is empty", "... control character 0x00
 * at byte 1", ...). Thread-safe, allocates nothing. */
int fps_name_check(const char *name, size_t len, char *why, size_t why_len);

/* Writes name[0..len) for a message into out (always NUL-terminated):
 * control characters and bytes that are not UTF-8 become \xNN, and a name
 * longer than max_bytes is cut on a character boundary and ends in "...".
 * Returns out. */
char *fps_name_quote(const char *name, size_t len, size_t max_bytes, char *out, size_t out_len);

/* Makes the NUL-terminated s valid UTF-8 in place, for a status message: a
 * sequence cut at the end (by a truncating snprintf) is dropped, and any
 * other byte that is not UTF-8 becomes '?'. Returns s. */
char *fps_utf8_fix(char *s);

#endif
