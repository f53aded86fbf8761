package replica

import (
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"
)

// TestCloseWhileDraining: before the drain a connection is kept alive;
// once draining, the next answer closes it after it is sent, and an idle
// connection is not cut before its client's next request (the request
// gets its answer, not EOF).
func TestCloseWhileDraining(t *testing.T) {
	var draining atomic.Bool
	srv := httptest.NewUnstartedServer(closeWhileDraining(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		_, _ = io.WriteString(w, "ok")
	}), &draining))
	var newConns atomic.Int64
	srv.Config.ConnState = func(_ net.Conn, s http.ConnState) { // before Start: the server reads it from then on
		if s == http.StateNew {
			newConns.Add(1)
		}
	}
	srv.Start()
	defer srv.Close()
	client := srv.Client()
	get := func() *http.Response {
		t.Helper()
		resp, err := client.Get(srv.URL)
		if err != nil {
			t.Fatalf("request: %v", err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		return resp
	}
	for i, c := range []struct {
		draining  bool
		wantClose bool
	}{
		{false, false},
		{false, false}, // the same connection, kept alive
		{true, true},   // the idle connection answers once more, then closes
		{true, true},   // a new connection, closed after its answer
	} {
		// The previous answer was read to the end, so its connection is
		// back in the client's idle pool (net/http returns it before the
		// body's EOF): it sits idle when the drain begins.
		draining.Store(c.draining)
		if resp := get(); resp.Close != c.wantClose || resp.StatusCode != http.StatusOK {
			t.Errorf("request %d (draining %v): status %d, Connection: close %v, want %v", i, c.draining, resp.StatusCode, resp.Close, c.wantClose)
		}
	}
	if n := newConns.Load(); n != 2 {
		t.Errorf("%d connections, want 2: one kept alive until the first answer of the drain, one after it", n)
	}
}
