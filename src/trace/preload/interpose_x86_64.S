// dlopen and dlsym of libforkguard_trace.so (x86-64).
//
// glibc's dlopen and dlsym look at their caller: dlopen searches the caller's RUNPATH for a bare
// name, dlsym(RTLD_NEXT) means "after the caller". A wrapper written in C would make this library
// the caller and change what the program gets. So these entry points ask a C function whether the
// call is one to watch and otherwise jump to the real function with the stack untouched: the real
// function sees the program's own return address.
//
//   dlopen: forkguard_trace_dlopen_pre(file, mode, caller) -> 1: forkguard_trace_dlopen_wrapped (a path,
//           no search involved), 0: the real dlopen, as if called directly
//   dlsym:  forkguard_trace_dlsym_pre(handle, name) -> 1: forkguard_trace_dlsym_wrapped (a
//           handle's cuInit / cuGetProcAddress), 0: the real dlsym, as if called directly

        .text

        .globl  dlopen
        .type   dlopen, @function
dlopen:
        .cfi_startproc
        endbr64
        pushq   %rdi
        .cfi_adjust_cfa_offset 8
        pushq   %rsi
        .cfi_adjust_cfa_offset 8
        subq    $8, %rsp
        .cfi_adjust_cfa_offset 8
        movq    24(%rsp), %rdx          // the caller's return address
        call    forkguard_trace_dlopen_pre
        addq    $8, %rsp
        .cfi_adjust_cfa_offset -8
        popq    %rsi
        .cfi_adjust_cfa_offset -8
        popq    %rdi
        .cfi_adjust_cfa_offset -8
        testl   %eax, %eax
        jnz     1f
        jmp     *forkguard_trace_real_dlopen(%rip)
1:
        jmp     forkguard_trace_dlopen_wrapped
        .cfi_endproc
        .size   dlopen, .-dlopen

        .globl  dlsym
        .type   dlsym, @function
dlsym:
        .cfi_startproc
        endbr64
        pushq   %rdi
        .cfi_adjust_cfa_offset 8
        pushq   %rsi
        .cfi_adjust_cfa_offset 8
        subq    $8, %rsp
        .cfi_adjust_cfa_offset 8
        call    forkguard_trace_dlsym_pre
        addq    $8, %rsp
        .cfi_adjust_cfa_offset -8
        popq    %rsi
        .cfi_adjust_cfa_offset -8
        popq    %rdi
        .cfi_adjust_cfa_offset -8
        testl   %eax, %eax
        jnz     1f
        jmp     *forkguard_trace_real_dlsym(%rip)
1:
        jmp     forkguard_trace_dlsym_wrapped
        .cfi_endproc
        .size   dlsym, .-dlsym

        .section .note.GNU-stack,"",@progbits
