//go:build unix

package api

import (
	"errors"
	"net"
	"syscall"
)

// isAlive reports whether an idle connection is still open: a peek that
// must not block finds nothing to read. The worker closing it shows as
// end of file (or a reset); bytes on an idle connection (a TLS close
// alert, anything unasked) mean it cannot carry a request either.
// http.Transport learns the same from a read it keeps pending on every
// idle connection, a goroutine per connection; this is one system call
// when the connection is taken.
func isAlive(c net.Conn) bool {
	sc, ok := c.(syscall.Conn)
	if !ok {
		return true // not a socket (tests' pipes): trust it
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return false
	}
	alive := false
	var b [1]byte
	err = rc.Read(func(fd uintptr) bool {
		n, _, rerr := syscall.Recvfrom(int(fd), b[:], syscall.MSG_PEEK|syscall.MSG_DONTWAIT)
		_ = n // 0 with no error is end of file, above 0 bytes nobody asked for
		alive = errors.Is(rerr, syscall.EAGAIN) || errors.Is(rerr, syscall.EWOULDBLOCK)
		return true
	})
	return err == nil && alive
}
