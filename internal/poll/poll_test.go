package poll_test

import (
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/internal/poll"
)

// fakeT records a failure instead of ending the test, so Until's failure
// path can be checked.
type fakeT struct{ failed string }

func (f *fakeT) Helper() {}
func (f *fakeT) Fatalf(format string, args ...any) {
	f.failed = fmt.Sprintf(format, args...)
}

func TestPollUntilHolds(t *testing.T) {
	calls := 0
	ft := &fakeT{}
	poll.Until(ft, 5*time.Second, time.Millisecond, func() error {
		calls++
		if calls < 3 {
			return errors.New("not yet")
		}
		return nil
	})
	if ft.failed != "" || calls != 3 {
		t.Fatalf("failed=%q calls=%d, want no failure after 3 calls", ft.failed, calls)
	}
}

func TestPollUntilTimesOut(t *testing.T) {
	ft := &fakeT{}
	start := time.Now()
	poll.Until(ft, 20*time.Millisecond, time.Millisecond, func() error { return errors.New("never") })
	if !strings.Contains(ft.failed, "never") {
		t.Fatalf("failure %q does not carry fn's last error", ft.failed)
	}
	if took := time.Since(start); took < 20*time.Millisecond {
		t.Fatalf("gave up after %v, before the 20ms deadline", took)
	}
}

// testing.TB satisfies T, so tests pass their t as is.
var _ poll.T = testing.TB(nil)
