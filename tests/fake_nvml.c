/* A fake NVML (libnvidia-ml) for the CPU tests of fp8kturbov._nvml: the five calls the package
 * makes, with their C signatures, answering from state that a test sets through fake_nvml_set and
 * fake_nvml_set_energy.
 * tests/test_nvml.py builds it as a shared library. */
#include <string.h>

typedef struct {
  unsigned long long reference_time;
  unsigned long long violation_time;
} ViolationTime;

enum { kSuccess = 0, kInvalidArgument = 2, kNotSupported = 3, kNotFound = 6 };

static const char kBusId[] = "0000:3b:00.0"; /* the one GPU, named as CUDA names it */
static int init_result, violation_result;
static unsigned long long held_ns[2]; /* per policy: 0 power, 1 thermal */
static int initialised;               /* nvmlInit_v2 successes not yet shut down */
static int energy_result;
static unsigned long long energy_mj;

void fake_nvml_set(int init, int violation, unsigned long long power_ns, unsigned long long thermal_ns) {
  init_result = init;
  violation_result = violation;
  held_ns[0] = power_ns;
  held_ns[1] = thermal_ns;
}

void fake_nvml_set_energy(int result, unsigned long long mj) {
  energy_result = result;
  energy_mj = mj;
}

int fake_nvml_initialised(void) { return initialised; }

int nvmlInit_v2(void) {
  if (init_result == kSuccess) ++initialised;
  return init_result;
}

int nvmlShutdown(void) {
  --initialised;
  return kSuccess;
}

int nvmlDeviceGetHandleByPciBusId_v2(const char* bus_id, void** device) {
  if (initialised <= 0 || bus_id == NULL || device == NULL) return kInvalidArgument;
  if (strcmp(bus_id, kBusId) != 0) return kNotFound;
  *device = held_ns;
  return kSuccess;
}

int nvmlDeviceGetViolationStatus(void* device, int policy, ViolationTime* status) {
  if (device != (void*)held_ns || status == NULL) return kInvalidArgument;
  if (violation_result != kSuccess) return violation_result;
  if (policy < 0 || policy > 1) return kNotSupported;
  status->reference_time = 0;
  status->violation_time = held_ns[policy];
  return kSuccess;
}

int nvmlDeviceGetTotalEnergyConsumption(void* device, unsigned long long* energy) {
  if (device != (void*)held_ns || energy == NULL) return kInvalidArgument;
  if (energy_result != kSuccess) return energy_result;
  *energy = energy_mj;
  return kSuccess;
}
