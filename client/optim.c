/* Public optimizer settings to the wire's AdafactorConfig.
 *
 * The wire marks presence with one-member oneofs (protobuf-c 1.4 has no
 * proto3 `optional`): a has_* flag set here sets the oneof's case, and an
 * unset one leaves the field absent so the shard applies the flavor's
 * upstream default. Which fields a flavor accepts is the shard's check (one
 * place decides, and its message names the tensor); the client only
 * refuses what it cannot encode. */
#include <math.h>
#include <stdio.h>

#include "error.h"
#include "factorps/v1/factorps.pb-c.h"
#include "internal.h"

#define SET_DOUBLE(field, CASE)                                                \
  do {                                                                         \
    if (in->has_##field) {                                                     \
      if (!isfinite(in->field)) {                                              \
        snprintf(err, errlen, #field " is not finite");                        \
        return FPS_EHPARAM;                                                    \
      }                                                                        \
      out->has_##field##_case = FACTORPS__V1__ADAFACTOR_CONFIG__HAS_##CASE;    \
      out->field = in->field;                                                  \
    }                                                                          \
  } while (0)

#define SET_BOOL(field, CASE)                                                  \
  do {                                                                         \
    if (in->has_##field) {                                                     \
      out->has_##field##_case = FACTORPS__V1__ADAFACTOR_CONFIG__HAS_##CASE;    \
      out->field = in->field ? 1 : 0;                                          \
    }                                                                          \
  } while (0)

int fps__optim_to_wire(const fps_optim_config_t *in, void *wire_cfg, char *err, size_t errlen) {
  Factorps__V1__AdafactorConfig *out = wire_cfg;
  factorps__v1__adafactor_config__init(out);
  switch (in->flavor) {
    case 0: /* documented default */
    case FPS_OPTIM_TORCH: out->flavor = FACTORPS__V1__FLAVOR__FLAVOR_TORCH; break;
    case FPS_OPTIM_HF: out->flavor = FACTORPS__V1__FLAVOR__FLAVOR_HF; break;
    default: snprintf(err, errlen, "unknown optimizer flavor %d", in->flavor); return FPS_EFLAVOR;
  }
  SET_DOUBLE(lr, LR_LR);
  SET_DOUBLE(beta2_decay, BETA2_DECAY_BETA2_DECAY);
  SET_DOUBLE(eps1, EPS1_EPS1);
  SET_DOUBLE(eps2, EPS2_EPS2);
  SET_DOUBLE(clip_threshold, CLIP_THRESHOLD_CLIP_THRESHOLD);
  SET_DOUBLE(weight_decay, WEIGHT_DECAY_WEIGHT_DECAY);
  SET_BOOL(maximize, MAXIMIZE_MAXIMIZE);
  SET_BOOL(relative_step, RELATIVE_STEP_RELATIVE_STEP);
  SET_BOOL(scale_parameter, SCALE_PARAMETER_SCALE_PARAMETER);
  SET_BOOL(warmup_init, WARMUP_INIT_WARMUP_INIT);
  SET_DOUBLE(beta1, BETA1_BETA1);
  return 0;
}
