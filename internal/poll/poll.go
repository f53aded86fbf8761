// Package poll is the one deadline-polling helper for every test package:
// a test never sleeps a guessed time to let something happen, it polls a
// condition until it holds or a deadline passes (docs/STYLE.md, Tests).
//
// It imports nothing but time, and takes the two methods of testing.TB it
// needs, so test-helper packages that are not _test files (clustertest,
// bustest) can use it without linking package testing's flags or anything
// else into a binary. Only tests and test helpers import it.
package poll

import "time"

// T is the part of testing.TB Until uses.
type T interface {
	Helper()
	Fatalf(format string, args ...any)
}

// Until calls fn every `every` until it returns nil, and fails t with fn's
// last error once total has elapsed. The last call is made after the
// deadline, so a condition that holds by then is not reported as a failure.
func Until(t T, total, every time.Duration, fn func() error) {
	t.Helper()
	deadline := time.Now().Add(total)
	for {
		err := fn()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("condition not met after %v: %v", total, err)
			return // a T whose Fatalf returns (not testing's) still stops here
		}
		time.Sleep(every)
	}
}
