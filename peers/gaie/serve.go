package gaie

import (
	"io"

	"github.com/go-logr/logr"
	ctrllog "sigs.k8s.io/controller-runtime/pkg/log"

	"github.com/kvrouter/kvrouter/internal/peerpolicy"
)

// Serve is the peer process's whole life: the peerpolicy protocol on r
// (its stdin) and w (its stdout) with a Policy built from the init line,
// until r ends. cmd/kvbench-gaie is this call; the tests run the test
// binary as the same peer.
func Serve(r io.Reader, w io.Writer) error {
	// Any GAIE code that logs without a context logger would otherwise,
	// after 30 s, make controller-runtime print a warning and a stack.
	ctrllog.SetLogger(logr.Discard())
	return peerpolicy.Serve(r, w, Name, func(in peerpolicy.Init) (peerpolicy.Policy, error) {
		p, err := New(in)
		if err != nil {
			return nil, err // not a nil *Policy in a non-nil interface
		}
		return p, nil
	})
}
