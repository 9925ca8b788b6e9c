// <cuda_runtime.h> for the emulator: everything is in cuda_emulator.h (included before every .cu).
#pragma once
#include "../cuda_emulator.h"
