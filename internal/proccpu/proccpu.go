// Package proccpu reads this process's CPU time, which benchmarks report
// beside the wall clock (cpu-ns/op and the like): on a shared machine the
// wall clock also counts the time other processes hold the cores, the CPU
// time (mostly) the benchmark's own work. One helper for every package's
// benchmarks, which each had their own copy.
package proccpu

import (
	"fmt"
	"syscall"
	"time"
)

// Self is the process's user + system CPU time so far. It panics if
// getrusage fails, which for RUSAGE_SELF and a valid pointer it cannot
// (EFAULT and EINVAL are its only errors): a benchmark reporting a made-up
// 0 would be worse than one that stops.
func Self() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		panic(fmt.Sprintf("getrusage: %v", err))
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
