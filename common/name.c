/* The tensor name rule and UTF-8 helpers for messages (name.h). */
#include "name.h"

#include <stdio.h>
#include <string.h>

#include "error.h"

size_t fps_utf8_seq(const unsigned char *s, size_t left) {
  unsigned c = s[0];
  size_t n;
  unsigned min, cp;
  if (c < 0x80) return 1;
  if (c >= 0xc2 && c <= 0xdf) n = 2, min = 0x80, cp = c & 0x1f;
  else if (c >= 0xe0 && c <= 0xef) n = 3, min = 0x800, cp = c & 0x0f;
  else if (c >= 0xf0 && c <= 0xf4) n = 4, min = 0x10000, cp = c & 0x07;
  else return 0;
  if (n > left) return 0;
  for (size_t i = 1; i < n; i++) {
    if ((s[i] & 0xc0) != 0x80) return 0;
    cp = (cp << 6) | (s[i] & 0x3f);
  }
  if (cp < min || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) return 0;
  return n;
}

bool fps_utf8_valid(const char *s, size_t n) {
  const unsigned char *u = (const unsigned char *)s;
  for (size_t i = 0; i < n;) {
    size_t k = fps_utf8_seq(u + i, n - i);
    if (k == 0) return false;
    i += k;
  }
  return true;
}

int fps_name_check(const char *name, size_t len, char *why, size_t why_len) {
  if (!name || len == 0) {
    snprintf(why, why_len, "tensor name is empty (names are 1..%d bytes of UTF-8)", FPS_TENSOR_NAME_MAX);
    return FPS_EINVAL;
  }
  char q[96];
  if (len > FPS_TENSOR_NAME_MAX) {
    snprintf(why, why_len, "tensor name '%s' is %zu bytes long, longer than the limit of %d",
             fps_name_quote(name, len, 40, q, sizeof q), len, FPS_TENSOR_NAME_MAX);
    return FPS_EINVAL;
  }
  const unsigned char *s = (const unsigned char *)name;
  for (size_t i = 0; i < len;) {
    if (s[i] < 0x20 || s[i] == 0x7f) {
      snprintf(why, why_len,
               "tensor name '%s' has a control character (0x%02x) at byte %zu: names are UTF-8 "
               "without control characters",
               fps_name_quote(name, len, 64, q, sizeof q), s[i], i);
      return FPS_EINVAL;
    }
    size_t k = fps_utf8_seq(s + i, len - i);
    if (k == 0) {
      snprintf(why, why_len, "tensor name '%s' is not valid UTF-8 (at byte %zu)",
               fps_name_quote(name, len, 64, q, sizeof q), i);
      return FPS_EINVAL;
    }
    i += k;
  }
  return 0;
}

char *fps_name_quote(const char *name, size_t len, size_t max_bytes, char *out, size_t out_len) {
  const unsigned char *s = (const unsigned char *)name;
  size_t o = 0;
  if (out_len == 0) return out;
  for (size_t i = 0; i < len;) {
    size_t k = (s[i] < 0x20 || s[i] == 0x7f) ? 0 : fps_utf8_seq(s + i, len - i);
    size_t w = k ? k : 4; /* bytes this character takes in out */
    if (i + (k ? k : 1) > max_bytes || o + w + 4 > out_len) {
      if (o + 4 <= out_len) memcpy(out + o, "...", 3), o += 3;
      break;
    }
    if (k) {
      memcpy(out + o, s + i, k);
      o += k;
      i += k;
    } else {
      snprintf(out + o, out_len - o, "\\x%02x", s[i]);
      o += 4;
      i++;
    }
  }
  out[o] = '\0';
  return out;
}

char *fps_utf8_fix(char *s) {
  unsigned char *u = (unsigned char *)s;
  size_t n = strlen(s);
  for (size_t i = 0; i < n;) {
    size_t k = fps_utf8_seq(u + i, n - i);
    if (k) {
      i += k;
      continue;
    }
    /* A lead byte whose sequence the end of the string cut short: drop the
     * tail. Anything else: replace the byte. */
    unsigned c = u[i];
    size_t want = c >= 0xc2 && c <= 0xdf ? 2 : c >= 0xe0 && c <= 0xef ? 3 : c >= 0xf0 && c <= 0xf4 ? 4 : 0;
    bool cut = want > n - i;
    for (size_t j = 1; cut && j < n - i; j++)
      if ((u[i + j] & 0xc0) != 0x80) cut = false;
    if (cut) {
      u[i] = '\0';
      break;
    }
    u[i++] = '?';
  }
  return s;
}
