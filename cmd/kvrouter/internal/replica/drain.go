package replica

import (
	"net/http"
	"sync/atomic"
)

// closeWhileDraining answers every request with "Connection: close" once
// draining is set, so each kept-alive connection ends cleanly after the
// answer its client asked for, and the client's next request opens a new
// connection, which the load balancer sends elsewhere.
//
// It replaces http.Server.SetKeepAlivesEnabled(false) at the start of the
// drain, which does the same for answers but also closes every idle
// connection at once. Behind an L4 balancer a client may have just written
// its next request on such a connection: that request then failed with
// EOF, and a POST is not retried by the client (chaos T8: HAProxy logged
// the session to the draining replica ended by the server, "SD", 8 ms after
// the drain began, and the route request written into it 3 ms after the
// drain began got EOF). Idle connections still close at Shutdown, after the
// drain delay, by when active clients have moved away.
func closeWhileDraining(h http.Handler, draining *atomic.Bool) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if draining.Load() {
			w.Header().Set("Connection", "close")
		}
		h.ServeHTTP(w, r)
	})
}
