// A handler of memory faults (SIGSEGV, SIGBUS) in device code: it names the kernel, block and
// thread and what the address was (a buffer's guard page, a fiber's stack guard), then aborts.
// Faults outside the emulator's blocks go to the handler that was installed before.
#pragma once

namespace emu {

// Installs the handler once per process.
void fault_handler_install();

// Gives the calling OS thread an alternate signal stack if it has none (a fiber's stack
// overflow cannot be reported on that stack); returns a token for fault_stack_remove.
void* fault_stack_ensure();
void fault_stack_remove(void* token);

}  // namespace emu
